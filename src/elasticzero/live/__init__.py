"""elasticzero.live: in-process reconfiguration of a ZeRO job — the workers' side of live recovery (issue 21).

Each round's fresh default group (:mod:`.group`), bounded waits that leave a collective stuck on a lost or frozen peer
once a new round is in the round file (:mod:`.bounded`), and the loop construct that enters each round — forms its
group, reshards the ZeRO state in memory (or hands a joining process its state from its peers) and redoes the step in
flight (:mod:`.loop`). The round file the agent writes and the workers watch, and the rest of the protocol, are
:mod:`elasticzero.rounds`. See docs/elastic-training.md, "Live reconfiguration".

Names resolve lazily (PEP 562): importing the package loads no torch.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "NodeRound": "elasticzero.rounds",
    "RoundError": "elasticzero.rounds",
    "RoundFile": "elasticzero.rounds",
    "StoreAddress": "elasticzero.rounds",
    "ROUND_FILE_ENV": "elasticzero.rounds",
    "write_round": "elasticzero.rounds",
    "Reconfigure": "elasticzero.live.bounded",
    "BoundedWait": "elasticzero.live.bounded",
    "LiveError": "elasticzero.live.bounded",
    "LiveTraining": "elasticzero.live.loop",
    "ReshardFallback": "elasticzero.live.loop",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
