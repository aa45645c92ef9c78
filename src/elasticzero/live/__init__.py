"""elasticzero.live: the training object of every run, and in-process reconfiguration of a ZeRO job — the workers'
side of live recovery.

:class:`Training` (:mod:`.training`) is what users train with, in a plain run and under ``--live-recovery`` alike:
enter it, iterate it (:class:`Done`: every committed step once), hook it (:class:`Hooks`). Beneath it: the
round file the agent writes and the workers watch (:mod:`.rounds`), each round's fresh default group
(:mod:`.group`), bounded waits that leave a collective stuck on a lost or frozen peer once a new round is in the file
(:mod:`.bounded`), and the loop construct that enters each round — forms its group, reshards the ZeRO state in memory
(or hands a joining process its state from its peers) and redoes the step in flight (:mod:`.loop`). See
docs/elastic-training.md, "Live reconfiguration".

Names resolve lazily (PEP 562): importing the package loads no torch.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "Training": "elasticzero.live.training",
    "Hooks": "elasticzero.live.training",
    "Done": "elasticzero.live.training",
    "LiveTraining": "elasticzero.live.loop",
    "Attempt": "elasticzero.live.loop",
    "LiveError": "elasticzero.live.bounded",
    "Reconfigure": "elasticzero.live.bounded",
    "ReshardFallback": "elasticzero.live.loop",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
