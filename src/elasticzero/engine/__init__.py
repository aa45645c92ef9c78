"""elasticzero.engine: ZeRO stages (``elasticzero.engine.zero``), loss scaling, precision, gradient accumulation,
timers, activation checkpointing, and the step helpers every loop shares. Names resolve lazily (PEP 562): importing
the package loads no torch.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "GradAccumulation": "elasticzero.engine.accumulation",
    "LossScaler": "elasticzero.engine.loss_scaler",
    "build_schedule": "elasticzero.engine.lr_schedules",
    "PhaseTimers": "elasticzero.engine.timers",
    "StepResult": "elasticzero.engine.step",
    "backward": "elasticzero.engine.step",
    "checkpoint_activations": "elasticzero.engine.activations",
    "clip_grad_norm": "elasticzero.engine.step",
    "optimizer_step": "elasticzero.engine.step",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
