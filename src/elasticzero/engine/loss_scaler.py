"""Loss scaling for fp16 training, shaped like :class:`torch.amp.GradScaler` and safe across ranks.

The loop is GradScaler's::

    scaler = LossScaler()                      # dynamic; LossScaler(dynamic=False, init_scale=1024.0) is static
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                       # optional: before clipping (the second call in a step is a no-op)
    opt.clip_grad_norm_(1.0)
    scaler.step(opt)                           # skipped (returns None) when any rank saw inf/NaN
    scaler.update()

Differences from GradScaler, on purpose:

* the inf/NaN flag is agreed across **all** ranks (``all_reduce(MAX)`` over the optimizer's ``process_group``, or the
  default group) before any rank steps, so a local overflow can never let ranks diverge;
* DeepSpeed's ``hysteresis``: the scale is reduced on the ``hysteresis``-th overflow only (1 = every overflow,
  GradScaler's behaviour); the counter refills when the scale grows (or after every clean step with
  ``consecutive_hysteresis=True``), exactly like DeepSpeed's ``DynamicLossScaler``;
* ``min_scale``: the scale is clamped to it, and an overflow that would push it below raises
  :class:`LossScaleUnderflowError` instead of skipping steps forever;
* a static scaler (``dynamic=False``) never changes the scale but still skips steps with inf/NaN gradients.

Optimizer protocol: an optimizer that owns its gradients (the ZeRO stages) exposes
``unscale_(inv_scale: float) -> Tensor`` (0-dim, 1.0 when it found inf/NaN locally) and ``process_group``; the scaler
uses them. Any other optimizer (plain ``torch.optim``, under DDP or not) has every ``p.grad`` in its ``param_groups``
unscaled by the scaler itself.

The flag's all-reduce is counted in ``scaler.comm_stats`` (tag ``"found_inf"``). It runs on the optimizer's group
as it is at that call (so it follows an optimizer whose communicator was replaced), else on ``scaler.communicator``
(built on ``process_group`` when one was given; assign another to move the scaler to a new group), else on the default
group as it is at that moment. The scaler builds one communicator per group it agrees on, at the first agreement there,
and reuses it; it holds the group weakly (a destroyed group's communicator goes with it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from elasticzero.engine.zero import comm
from elasticzero.errors import ElasticZeroError, UsageError

__all__ = ["LossScaleUnderflowError", "LossScaler"]


class LossScaleUnderflowError(ElasticZeroError, RuntimeError):
    """The loss scale would drop below ``min_scale``: training is diverging (or min_scale is too high)."""


class LossScaler:
    """Static or dynamic loss scaler with cross-rank overflow agreement (see the module docstring)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        dynamic: bool = True,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        process_group: Any = None,
        enabled: bool = True,
    ) -> None:
        """Create a scaler.

        ``init_scale``: starting scale. ``growth_factor`` (> 1) multiplies the scale after ``growth_interval``
        consecutive clean steps; ``backoff_factor`` (in (0, 1)) multiplies it on the ``hysteresis``-th overflow.
        ``min_scale``: lower bound (see :class:`LossScaleUnderflowError`). ``process_group``: where the overflow flag
        is agreed for optimizers without their own ``process_group`` (default: the default group).
        ``enabled=False`` makes every method a pass-through, like ``GradScaler(enabled=False)``.
        """
        if init_scale <= 0:
            raise UsageError(f"loss scaler: init_scale must be > 0, got {init_scale}")
        if growth_factor <= 1.0:
            raise UsageError(f"loss scaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise UsageError(f"loss scaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise UsageError(f"loss scaler: growth_interval must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise UsageError(f"loss scaler: hysteresis must be >= 1, got {hysteresis}")
        if min_scale <= 0 or min_scale > init_scale:
            raise UsageError(f"loss scaler: min_scale must be in (0, init_scale={init_scale}], got {min_scale}")
        self.enabled = enabled
        self.dynamic = dynamic
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.comm_stats = comm.CommStats()
        # the group held weakly (see comm.Communicator); None = the default group, looked up at each use
        self.communicator: comm.Communicator | None = None
        if process_group is not None:
            self.communicator = comm.Communicator(process_group, owner="LossScaler", stats=self.comm_stats)
        # the communicators of the other groups it agrees on (optimizers' own, the default group), one per group
        self._borrowed: weakref.WeakKeyDictionary[Any, comm.Communicator] = weakref.WeakKeyDictionary()
        self._scale = float(init_scale)
        self._growth_tracker = 0  # consecutive clean steps since the last overflow or growth
        self._hysteresis_left = self.hysteresis
        self.skipped_steps = 0
        # id(optimizer) -> {"found_inf": bool, "stepped": bool}; cleared by update()
        self._per_optimizer: dict[int, dict[str, bool]] = {}

    @property
    def process_group(self) -> Any:
        """The group of :attr:`communicator` (None: the default group); a :class:`UsageError` once destroyed."""
        return None if self.communicator is None else self.communicator.group

    # ---------------------------------------------------------------- GradScaler-shaped API
    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self.enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (the loss itself when disabled); call ``.backward()`` on the result.

        A half-precision loss is scaled in fp32 (as DeepSpeed does), so ``2.0 * 65536`` does not overflow fp16's
        65504 before backward even starts.
        """
        if not self.enabled:
            return loss
        if not isinstance(loss, torch.Tensor):
            raise UsageError(f"LossScaler.scale expects a tensor, got {type(loss).__name__}")
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self._scale

    def unscale_(self, optimizer: Any) -> bool:
        """Divide the optimizer's gradients by the scale and agree on inf/NaN across ranks; True if any rank found one.

        Idempotent within a step: a second call before :meth:`update` returns the recorded result without touching
        the gradients again (GradScaler raises instead).
        """
        if not self.enabled:
            return False
        state = self._per_optimizer.get(id(optimizer))
        if state is not None:
            if state["stepped"]:
                raise RuntimeError("LossScaler.unscale_() called after step() in the same iteration; call update()")
            return state["found_inf"]
        inv_scale = 1.0 / self._scale
        own_unscale = getattr(optimizer, "unscale_", None)
        group = None
        if callable(own_unscale):
            local = own_unscale(inv_scale)
            group = getattr(optimizer, "process_group", None)
        else:
            local = _unscale_grads(_grads_of(optimizer), inv_scale)
        found = _agree(local, self._communicator_on(group))
        self._per_optimizer[id(optimizer)] = {"found_inf": found, "stepped": False}
        return found

    def _communicator_on(self, group: Any) -> comm.Communicator | None:
        """Where the overflow flag is agreed: on ``group`` (the optimizer's), else on :attr:`communicator`, else on
        the default group as it is now (the scaler's communicator for that group, built at its first agreement); None
        without torch.distributed."""
        if group is None and self.communicator is not None:
            return self.communicator
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return None
        pg = group if group is not None else dist.group.WORLD
        found = _held(self._borrowed, pg)
        if found is None:
            found = self._borrowed[pg] = comm.Communicator(pg, owner="LossScaler", stats=self.comm_stats)
        return found

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Unscale if not done yet, then ``optimizer.step(*args, **kwargs)`` unless some rank found inf/NaN.

        Returns what ``optimizer.step`` returns, or None when the step was skipped (counted in ``skipped_steps``).
        """
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        state = self._per_optimizer.get(id(optimizer))
        if state is not None and state["stepped"]:
            raise RuntimeError("LossScaler.step() already called for this optimizer since the last update()")
        found = self.unscale_(optimizer)
        self._per_optimizer[id(optimizer)]["stepped"] = True
        if found:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """End the iteration: adjust the scale from this step's (agreed) overflow result.

        ``new_scale`` sets the scale explicitly instead (like GradScaler). Raises :class:`LossScaleUnderflowError`
        when an overflow would take a dynamic scale below ``min_scale``.
        """
        if not self.enabled:
            return
        states, self._per_optimizer = self._per_optimizer, {}
        if new_scale is not None:
            if new_scale <= 0:
                raise UsageError(f"loss scaler: new_scale must be > 0, got {new_scale}")
            self._scale = float(new_scale)
            return
        if not states:
            raise RuntimeError("LossScaler.update(): no unscale_() or step() was recorded since the last update()")
        found = any(s["found_inf"] for s in states.values())
        if self.dynamic:
            self._update_dynamic(found)

    def count_taken_step(self) -> None:
        """Count a step taken without overflow whose gradients this scaler never saw (a step another process took: the
        live reshard's step counted done): the scale moves as :meth:`update` moves it after a clean step."""
        if self.enabled and self.dynamic:
            self._update_dynamic(False)

    def _update_dynamic(self, overflow: bool) -> None:
        if overflow:
            self._growth_tracker = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
                return
            if self._scale <= self.min_scale:
                raise LossScaleUnderflowError(
                    f"loss scale would drop below min_scale={self.min_scale:g} after {self.skipped_steps} skipped "
                    "steps: gradients keep overflowing (diverging run or bad data); lower min_scale or fix the cause"
                )
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._scale *= self.growth_factor
            self._growth_tracker = 0
            self._hysteresis_left = self.hysteresis

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Scale, counters and settings (plain Python numbers; DCP-friendly). Empty when disabled, like GradScaler."""
        if not self.enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
            "skipped_steps": self.skipped_steps,
            "dynamic": self.dynamic,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (settings included, as GradScaler does)."""
        if not self.enabled:
            return
        if not state_dict:
            raise UsageError("LossScaler.load_state_dict: empty state (was it saved from a disabled scaler?)")
        missing = {"scale", "growth_tracker", "hysteresis_left", "skipped_steps"} - state_dict.keys()
        if missing:
            raise UsageError(f"LossScaler.load_state_dict: missing keys {sorted(missing)}")
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_left = int(state_dict["hysteresis_left"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        for key in ("dynamic", "consecutive_hysteresis"):
            if key in state_dict:
                setattr(self, key, bool(state_dict[key]))
        for key in ("growth_factor", "backoff_factor", "min_scale"):
            if key in state_dict:
                setattr(self, key, float(state_dict[key]))
        for key in ("growth_interval", "hysteresis"):
            if key in state_dict:
                setattr(self, key, int(state_dict[key]))
        self._per_optimizer = {}

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.get_scale():g}, skipped_steps={self.skipped_steps})"


# -------------------------------------------------------------------- pure helpers
def _grads_of(optimizer: Any) -> list[torch.Tensor]:
    """Every dense gradient, or the values of every (coalesced, in place) sparse gradient, of ``optimizer``."""
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                p.grad = p.grad.coalesce()
                grads.append(p.grad._values())
            else:
                grads.append(p.grad)
    return grads


def _unscale_grads(grads: Iterable[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; 0-dim float tensor, 1.0 if any was inf/NaN."""
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    found_total = torch.zeros(())
    for (device, _), tensors in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
        except (RuntimeError, NotImplementedError):  # an op/device/dtype without the fused kernel
            for t in tensors:
                if not bool(torch.isfinite(t).all()):
                    found.fill_(1.0)
                t.mul_(inv_scale)
        found_total = torch.maximum(found_total, found.cpu())
    return found_total


def _held(held: weakref.WeakKeyDictionary[Any, comm.Communicator], group: Any) -> comm.Communicator | None:
    """The communicator ``held`` for ``group``; None for a new group and for what is no group at all (NON_GROUP_MEMBER:
    building one says why)."""
    try:
        return held.get(group)
    except TypeError:  # not weakly referable, so not a process group
        return None


def _agree(local: torch.Tensor | float | bool, communicator: comm.Communicator | None) -> bool:
    """MAX of the local inf/NaN flag over the communicator's group, if any; every rank gets the same answer.

    The flag may live on a GPU (a ZeRO optimizer's ``unscale_`` returns it on its parameters' device): nccl reduces it
    there (a CPU flag goes to the current CUDA device), other backends on the CPU; ``.item()`` (the one host sync)
    comes after the reduction."""
    flag = torch.as_tensor(local, dtype=torch.float32).reshape(())
    if communicator is not None and communicator.size > 1:
        device = torch.device("cpu")
        if "nccl" in communicator.backend.lower():
            device = flag.device if flag.is_cuda else torch.device("cuda", torch.cuda.current_device())
        flag = flag.to(device).clone()
        communicator.all_reduce(flag, op=dist.ReduceOp.MAX, tag="found_inf")
    return bool(flag.item() > 0)
