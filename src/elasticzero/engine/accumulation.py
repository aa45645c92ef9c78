"""Gradient accumulation bookkeeping: which micro-batch ends an optimizer step, and the 1/steps loss factor.

::

    acc = GradAccumulation(steps=4)
    for x, y in loader:
        with acc.no_sync(model, opt):                 # DDP's or ZeRO 1/2's no_sync() except on the boundary
            (acc.scale_loss(loss_fn(model(x), y))).backward()
        if acc.advance():                             # True on every 4th micro-batch
            opt.step(); opt.zero_grad()

Dividing each micro-batch loss by ``steps`` makes the accumulated gradient the mean over the global batch, as one
big batch would give (and as DeepSpeed does internally).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

from elasticzero.errors import UsageError

__all__ = ["GradAccumulation"]


class GradAccumulation:
    """Micro-step counter for ``steps`` micro-batches per optimizer step (``steps=1``: every micro-batch steps)."""

    def __init__(self, steps: int = 1) -> None:
        """``steps`` >= 1 micro-batches per optimizer step."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise UsageError(f"gradient accumulation steps must be an integer >= 1, got {steps!r}")
        self.steps = steps
        self.micro_step = 0  # micro-batches seen so far (never reset; checkpointed)

    @property
    def is_boundary(self) -> bool:
        """Whether the *current* micro-batch (the one before the next :meth:`advance`) ends an optimizer step."""
        return (self.micro_step + 1) % self.steps == 0

    def scale_loss(self, loss: Any) -> Any:
        """``loss / steps`` (the loss itself when ``steps == 1``)."""
        return loss if self.steps == 1 else loss / self.steps

    def no_sync(self, *targets: Any) -> AbstractContextManager[Any]:
        """``target.no_sync()`` of each target unless this micro-batch is a boundary; a target without ``no_sync``,
        or saying ``supports_no_sync = False`` (ZeRO stage 3, whose gradients are sharded as they are produced), is
        skipped. Pass the module and the optimizer (``acc.no_sync(model, opt)``) and the same loop defers DDP's
        all-reduce (the module has it) or a ZeRO stage's reduce-scatter (the optimizer has it)."""
        deferring = [t for t in targets if hasattr(t, "no_sync") and getattr(t, "supports_no_sync", True)]
        if self.is_boundary or not deferring:
            return nullcontext()
        with ExitStack() as stack:  # one target failing to enter leaves none entered
            for target in deferring:
                stack.enter_context(target.no_sync())
            return stack.pop_all()

    def advance(self) -> bool:
        """Count one micro-batch; True when it completed an optimizer step (time to ``step``/``zero_grad``)."""
        boundary = self.is_boundary
        self.micro_step += 1
        return boundary

    def state_dict(self) -> dict[str, int]:
        """``{"steps", "micro_step"}``."""
        return {"steps": self.steps, "micro_step": self.micro_step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore the micro-step counter; the configured ``steps`` wins when it changed (a new accumulation)."""
        self.micro_step = int(state_dict["micro_step"])
