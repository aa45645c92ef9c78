"""elasticzero: DeepSpeed's launcher, elastic agent and ZeRO engine as small composable torch pieces.

Every piece can be imported on its own; nothing here imports torch until a piece is used, so
``import elasticzero.launch`` stays cheap on a login node.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

__version__ = "0.1.0"

# public name -> module that defines it (resolved lazily, PEP 562)
_LAZY = {
    "ZeroStage1": "elasticzero.engine.zero",
    "ZeroStage2": "elasticzero.engine.zero",
    "ZeroStage3": "elasticzero.engine.zero",
    "LossScaler": "elasticzero.engine.loss_scaler",
    "GradBucketer": "elasticzero.engine.bucketer",
    "PhaseTimers": "elasticzero.engine.timers",
    "GradAccumulation": "elasticzero.engine.accumulation",
    "PrecisionPolicy": "elasticzero.engine.precision",
    "optimizer_step": "elasticzero.engine.step",
    "build_pieces": "elasticzero.config.build",
    "load_config": "elasticzero.config.load",
    "init_distributed": "elasticzero.device",
    "heartbeat": "elasticzero.progress",
    "Training": "elasticzero.live.training",
    "Checkpointer": "elasticzero.checkpoint",
}

__all__ = ["__version__", *_LAZY]

__getattr__ = lazy_getattr(__name__, _LAZY)
