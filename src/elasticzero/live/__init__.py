"""elasticzero.live: in-process reconfiguration of a ZeRO job — the workers' side of live recovery (issue 21).

A round source the workers watch (:mod:`.rounds`), bounded waits that leave a collective stuck on a lost or frozen
peer once a new round is announced (:mod:`.bounded`), and the loop construct that reforms the group, reshards the ZeRO
state in memory and redoes the step in flight (:mod:`.loop`). See docs/elastic-training.md, "Live reconfiguration".

Names resolve lazily (PEP 562): importing the package loads no torch.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "Round": "elasticzero.live.rounds",
    "RoundError": "elasticzero.live.rounds",
    "RoundSource": "elasticzero.live.rounds",
    "announce": "elasticzero.live.rounds",
    "Reconfigure": "elasticzero.live.bounded",
    "BoundedWait": "elasticzero.live.bounded",
    "LiveError": "elasticzero.live.bounded",
    "LiveTraining": "elasticzero.live.loop",
    "ReshardFallback": "elasticzero.live.loop",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
