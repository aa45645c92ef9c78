"""ZeRO stages 1/2/3 as optimizers that wrap any ``torch.optim.Optimizer`` class (see ``docs/engine.md``).

``ZeroStage1`` shards optimizer state, ``ZeroStage2`` also gradients, ``ZeroStage3`` also parameters. Names resolve
lazily (PEP 562) so that ``elasticzero.engine.zero.comm`` can be imported without importing the stages.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ZeroStage1": "elasticzero.engine.zero.stage1",
    "ZeroStage2": "elasticzero.engine.zero.stage2",
    "ZeroStage3": "elasticzero.engine.zero.stage3",
    "CommStats": "elasticzero.engine.zero.comm",
    "GLOBAL_COMM_STATS": "elasticzero.engine.zero.comm",
    "FlatBucket": "elasticzero.engine.zero.flat",
    "ParamSlot": "elasticzero.engine.zero.flat",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elasticzero.engine.zero' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
