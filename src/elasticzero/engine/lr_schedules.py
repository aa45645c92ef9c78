"""DeepSpeed's learning-rate schedules (``scheduler: {type, params}`` of a ``ds_config``) as torch ``LRScheduler``\\s.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take DeepSpeed 0.19's
parameters, with its defaults, and set the learning rate DeepSpeed's engine would use at every optimizer step::

    sched = build_schedule(opt, "WarmupDecayLR", {"total_num_steps": 1000, "warmup_num_steps": 100})
    for batch in loader:
        ...
        opt.step()
        sched.step()            # after the optimizer step; not after a skipped (fp16 overflow) step

The counting is DeepSpeed's ``last_batch_iteration``: -1 before the first optimizer step (the constructor sets the
schedule's starting value, e.g. ``warmup_min_lr``), then one more after each ``step()``; the ``n``-th optimizer step
(from 1) runs at the value for iteration ``n - 2``, so the first two steps of a warmup both run at its start, as in
DeepSpeed. torch's ``last_epoch`` counts the steps since construction: ``last_batch_iteration = start + last_epoch``
where ``start`` is the ``last_batch_iteration`` given (DeepSpeed's resume parameter: with ``start != -1`` the
constructor leaves the optimizer's learning rate alone and the first ``step()`` moves to ``start + 1``).

The state (``state_dict()``) is ``{"last_batch_iteration": n}``, independent of the world size; loading it also sets
the optimizer's learning rate to the value for ``n``, so a resumed job continues the uninterrupted run's sequence
whatever the optimizer's checkpoint holds.

Values DeepSpeed refuses are refused (:func:`~elasticzero.config.schedules.check_schedule`, one
:class:`~elasticzero.errors.UsageError` line; :mod:`elasticzero.config.schedules` declares each schedule's parameters
and defaults, which the classes here take), and one it only warns about: an unknown ``warmup_type`` (DeepSpeed falls
back to log; a typo should not change the schedule). Whole numbers may be written as ``1000.0`` (JSON). ``OneCycle``
cycles the first beta of an optimizer with ``betas`` (setting the second to 0.99, as DeepSpeed does) and warns and
leaves the momentum alone otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from elasticzero.config.schedules import check_schedule, schedule_name, whole_numbers
from elasticzero.errors import UsageError

__all__ = [
    "SCHEDULES",
    "DeepSpeedSchedule",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_schedule",
    "schedule_class",
]


Lrs = float | Sequence[float]  # one value for every parameter group, or one per group


class DeepSpeedSchedule(LRScheduler):
    """A schedule counted in DeepSpeed's ``last_batch_iteration`` (see the module docstring). Subclasses define
    :meth:`lrs_at`: the learning rate of each parameter group at an iteration, -1 included."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.start = last_batch_iteration
        super().__init__(optimizer)  # its initial step sets the value for iteration ``start`` (see get_lr)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: -1 before the first step, then one more per :meth:`step`."""
        return self.start + self.last_epoch

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The learning rates for :attr:`last_batch_iteration`; the optimizer's own at a resume's first value."""
        if self.last_epoch == 0 and self.start != -1:  # DeepSpeed sets nothing when it starts from a given iteration
            return [float(g["lr"]) for g in self.optimizer.param_groups]
        return self.lrs_at(self.last_batch_iteration)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict["last_batch_iteration"]``: the optimizer's learning rates become that
        iteration's, as in the run that saved it."""
        self.last_epoch = int(state_dict["last_batch_iteration"]) - self.start
        self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates the optimizer's groups hold now (set by this schedule at construction, each step and
        each load)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]


def _per_group(optimizer: torch.optim.Optimizer, value: Lrs, name: str) -> list[float]:
    """DeepSpeed's per-group values: one number for every group, or a list with one per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise UsageError(f"scheduler.params.{name}: {len(value)} values for {n} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * n  # type: ignore[arg-type]


def _warmup_gamma(iteration: int, warmup: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (< ``warmup``): log(it + 1) / log(warmup), or it / warmup."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup)) * math.log(iteration + 1)
    return iteration / warmup


class WarmupLR(DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's ``lr``) over ``warmup_num_steps`` (at
    least 2) steps, log or linear, then constant."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: Lrs = 0.0,
        warmup_max_lr: Lrs | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_max_lr is None:  # the optimizer's own learning rate (WarmupDecayLR's default is 0.001)
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]

    def gamma(self, iteration: int) -> float:
        """Where the learning rate is between min (0) and max (1) at ``iteration`` >= 0."""
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR` (``warmup_max_lr`` defaults to 0.001 here), then linear decay to 0 at
    ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: Lrs = 0.0,
        warmup_max_lr: Lrs = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        left = float(self.total_num_steps - iteration)
        return max(0.0, left / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """Ratios of the optimizer's own learning rate: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps`` (log or
    linear), then a half cosine down to ``cos_min_ratio`` at ``total_num_steps``, and that floor after it (also
    straight after the warmup when ``total_num_steps`` is not above it)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]

    def ratio(self, iteration: int) -> float:
        """The multiple of the optimizer's learning rate at ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))  # at the floor past the end
        half = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half)


class LRRangeTest(DeepSpeedSchedule):
    """From ``lr_range_test_min_lr`` up by ``lr_range_test_step_rate`` x its value every ``lr_range_test_step_size``
    steps: continuously, or in stairs (``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: Lrs = 0.001,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        interval = float(iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [lr * increase for lr in self.min_lrs]


class OneCycle(DeepSpeedSchedule):
    """One cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` (``cycle_first_step_size`` steps) and back
    (``cycle_second_step_size``, default the first), in stairs when the half's stair count is > 0, then
    ``cycle_min_lr / (1 + decay_lr_rate * k)`` after ``k`` ``decay_step_size`` intervals (no decay when either is 0).
    With ``cycle_momentum`` the first beta moves the other way, between ``cycle_max_mom`` and ``cycle_min_mom``, and
    grows by ``decay_mom_rate`` after the cycle. Learning rates and momenta: one value, or one per group."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: Lrs,
        cycle_max_lr: Lrs,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: Lrs = 0.8,
        cycle_max_mom: Lrs = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.first_size = float(cycle_first_step_size)
        self.second_size = self.first_size if cycle_second_step_size is None else float(cycle_second_step_size)
        self.total_size = self.first_size + self.second_size
        self.step_ratio = self.first_size / self.total_size
        self.stairs = (cycle_first_stair_count, cycle_first_stair_count if cycle_second_stair_count is None
                       else cycle_second_stair_count)  # fmt: skip
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.lr_decay = 0.0 if math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0) else decay_lr_rate
        self.cycle_momentum = cycle_momentum and _has_betas(optimizer)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.mom_decay = 0.0 if math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0) else decay_mom_rate
        super().__init__(optimizer, last_batch_iteration)

    def step(self, epoch: int | None = None) -> None:
        """The learning rate for the next iteration, and the first beta with ``cycle_momentum``."""
        super().step(epoch)
        self._set_betas()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._set_betas()

    def _set_betas(self) -> None:
        if self.cycle_momentum and not (self.last_epoch == 0 and self.start != -1):
            for group, beta in zip(self.optimizer.param_groups, self.betas_at(self.last_batch_iteration), strict=True):
                group["betas"] = (beta, 0.99)  # DeepSpeed's: the second beta becomes 0.99

    def scale(self, iteration: int) -> float:
        """How far up the cycle iteration ``iteration`` is: 0 at ``cycle_min_lr``, 1 at ``cycle_max_lr``."""
        done = iteration + 1
        x = 1.0 + done / self.total_size - math.floor(1 + done / self.total_size)
        up = x <= self.step_ratio
        stairs = self.stairs[0] if up else self.stairs[1]
        if stairs <= 0:
            return x / self.step_ratio if up else (x - 1) / (self.step_ratio - 1)
        at = done % self.total_size  # stairs counted from the whole step, not from the rounded x
        position = at * stairs / self.first_size if at <= self.first_size else (
            (self.total_size - at) * stairs / self.second_size)  # fmt: skip
        return math.floor(position) / stairs

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            s = self.scale(iteration)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if not self.lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.lr_decay * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def betas_at(self, iteration: int) -> list[float]:
        """Each group's first beta at ``iteration`` (-1: ``cycle_min_mom``, DeepSpeed's starting value)."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            s = self.scale(iteration)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if not self.mom_decay:
            return list(self.max_moms)
        factor = 1 + self.mom_decay * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]


def _has_betas(optimizer: torch.optim.Optimizer) -> bool:
    if "betas" in optimizer.defaults:
        return True
    logging.getLogger(__name__).warning("OneCycle: cycle_momentum is off: %s has no betas", type(optimizer).__name__)
    return False


#: name -> class, in the order of :data:`~elasticzero.config.schedules.SCHEDULE_PARAMS`, which declares each one's
#: constructor parameters and defaults (config validation reads that table; a unit test compares it with these)
SCHEDULES: Mapping[str, type[DeepSpeedSchedule]] = MappingProxyType(
    {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
)


def schedule_class(name: str, source: str = "<config>") -> type[DeepSpeedSchedule]:
    """The schedule called ``name`` (DeepSpeed's spelling), or a :class:`UsageError` naming the valid ones."""
    return SCHEDULES[schedule_name(name, source)]


def build_schedule(
    optimizer: torch.optim.Optimizer, name: str, params: Mapping[str, Any], source: str = "<config>"
) -> DeepSpeedSchedule:
    """The schedule ``name`` with DeepSpeed's ``params`` on ``optimizer`` (checked by :func:`check_schedule`); it
    sets the optimizer's learning rate for the first step now."""
    check_schedule(name, params, source)
    return SCHEDULES[name](optimizer, **whole_numbers(params))
