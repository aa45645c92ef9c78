"""The end of a training step, the same for every optimizer: unscale → clip → step → update → zero_grad.

::

    for x, y in micro_batches:                       # accumulated backward passes
        backward(loss_fn(model(x), y), scaler)       # scaler.scale(loss).backward(), or loss.backward()
    result = optimizer_step(opt, scaler=scaler, max_norm=1.0)

``opt`` is a ZeRO stage (it owns its gradients: its own ``unscale_`` and global-norm ``clip_grad_norm_``) or any plain
``torch.optim`` optimizer (under DDP or alone: ``p.grad`` is unscaled and clipped with
``torch.nn.utils.clip_grad_norm_``); ``scaler`` is a :class:`~elasticzero.engine.loss_scaler.LossScaler` or None. The
loop has no branch on either. With a scaler, the overflow verdict is agreed across ranks before anything else, so on
an overflow every rank skips the clip (and its collective) and the step alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elasticzero.progress import reporter

if TYPE_CHECKING:
    from elasticzero.engine.loss_scaler import LossScaler

__all__ = ["StepResult", "backward", "clip_grad_norm", "optimizer_step"]


@dataclass(frozen=True)
class StepResult:
    """What :func:`optimizer_step` did."""

    skipped: bool  # the scaler found inf/NaN on some rank: no update (counted in ``scaler.skipped_steps``)
    grad_norm: torch.Tensor | None  # total norm before clipping; None when clipping is off or the step was skipped


def backward(loss: torch.Tensor, scaler: LossScaler | None = None) -> None:
    """``scaler.scale(loss).backward()``, or ``loss.backward()`` without a scaler."""
    (loss if scaler is None else scaler.scale(loss)).backward()


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the optimizer's gradients to total norm ``max_norm``; returns the norm before clipping.

    A ZeRO optimizer clips by its global norm over all shards (its ``clip_grad_norm_``); any other optimizer has the
    gradients in its ``param_groups`` clipped by ``torch.nn.utils.clip_grad_norm_`` (replicated gradients: DDP)."""
    own = getattr(optimizer, "clip_grad_norm_", None)
    if callable(own):
        return own(max_norm)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def optimizer_step(
    optimizer: torch.optim.Optimizer, *, scaler: LossScaler | None = None, max_norm: float | None = None
) -> StepResult:
    """Unscale (with ``scaler``), clip to ``max_norm`` (None: no clipping), step, update the scale, zero the grads.

    The gradients are released (``zero_grad(set_to_none=True)``) whether the step was taken or skipped. The step is
    reported to the agent as progress (:func:`elasticzero.heartbeat`; a no-op outside ``elasticzero-run``)."""
    skipped = bool(scaler.unscale_(optimizer)) if scaler is not None else False
    norm = clip_grad_norm(optimizer, max_norm) if max_norm is not None and not skipped else None
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    reporter().step()
    return StepResult(skipped=skipped, grad_norm=norm)
