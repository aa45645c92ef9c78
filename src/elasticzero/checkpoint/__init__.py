"""Checkpoints on torch DCP that reshard: save at N ranks and ZeRO stage s, load at any M and stage s'.

``Checkpointer`` (atomic commit, ``keep_last``, async save), ``FlatChunk`` (the element-range state-dict leaf the
ZeRO stages use), the DCP planners and the ``elasticzero-checkpoint`` CLI. See ``docs/checkpointing.md``.
Names resolve lazily (PEP 562) so that importing the package does not import torch.distributed.checkpoint.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "Checkpointer": "elasticzero.checkpoint.checkpointer",
    "FlatChunk": "elasticzero.engine.zero.layout",
    "RNGState": "elasticzero.checkpoint.rng",
    "ReplicatedState": "elasticzero.checkpoint.replicated",
    "Snapshot": "elasticzero.checkpoint.snapshot",
    "DiskTier": "elasticzero.checkpoint.disk",
    "FencedError": "elasticzero.checkpoint.fence",
    "ZeroSavePlanner": "elasticzero.checkpoint.planner",
    "ZeroLoadPlanner": "elasticzero.checkpoint.planner",
    "SafeFileSystemReader": "elasticzero.checkpoint.planner",
    "ZeroCheckpointState": "elasticzero.engine.zero.dcp_state",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
