"""The config's ``scheduler`` section: DeepSpeed's LR schedule names, each one's parameters with their defaults, the
kind of value each parameter takes, and the check of ``scheduler.type``/``params`` (plain data and pure functions).

:data:`SCHEDULE_PARAMS` is the one declaration of every schedule's parameters: config validation
(:func:`check_schedule`) reads it, and the engine's schedule classes (:mod:`elasticzero.engine.lr_schedules`, which
imports it) take exactly these constructor parameters with these defaults (a unit test compares them)::

    check_schedule("WarmupDecayLR", {"total_num_steps": 1000}, "ds.json")     # or one UsageError line
    whole_numbers({"warmup_num_steps": 1000.0})                              # {"warmup_num_steps": 1000}
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

from elasticzero.errors import UsageError

__all__ = ["REQUIRED", "SCHEDULE_PARAMS", "check_schedule", "schedule_name", "whole_numbers"]


class _Required:
    """The marker of a parameter without a default (the config must give it)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final = _Required()

# schedule (DeepSpeed's spelling) -> {parameter: default, or REQUIRED}, in the constructor's order (error messages
# list them so); read only through SCHEDULE_PARAMS, its read-only view
_DECLARED: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupDecayLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupCosineLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "OneCycle": {
        "cycle_min_lr": REQUIRED,
        "cycle_max_lr": REQUIRED,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
        "last_batch_iteration": -1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
        "last_batch_iteration": -1,
    },
}
#: schedule -> {parameter: default, or :data:`REQUIRED`}: the one declaration of each schedule's parameters
SCHEDULE_PARAMS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType(params) for name, params in _DECLARED.items()}
)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v: Any) -> bool:
    return _number(v) and float(v).is_integer()


def _lrs(v: Any) -> bool:
    return (_number(v) and v >= 0) or (
        isinstance(v, (list, tuple)) and bool(v) and all(_number(x) and x >= 0 for x in v)
    )


# kind -> (accepts the value?, what it must be)
_KINDS: Mapping[str, tuple[Callable[[Any], bool], str]] = MappingProxyType(
    {
        "lr": (_lrs, "a learning rate >= 0 (or a list: one per parameter group)"),
        "lr_or_null": (
            lambda v: v is None or _lrs(v),
            "a learning rate >= 0, a list of them or null (the optimizer's)",
        ),
        "count": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
        "count_or_null": (lambda v: v is None or (_whole(v) and v >= 0), "a whole number >= 0 (or null)"),
        "size": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
        "number": (_number, "a number"),
        "numbers": (
            lambda v: _number(v) or (isinstance(v, (list, tuple)) and bool(v) and all(_number(x) for x in v)),
            "a number (or a list: one per parameter group)",
        ),
        "ratio": (lambda v: _number(v) and v >= 0, "a number >= 0"),
        "flag": (lambda v: isinstance(v, bool), "true or false"),
        "warmup_type": (lambda v: v in ("log", "linear"), "'log' or 'linear'"),
        "iteration": (lambda v: _whole(v) and v >= -1, "a whole number >= -1 (-1: from the start)"),
    }
)
#: the kinds whose values the schedules take as ``int`` (JSON may write ``1000.0``)
_WHOLE_KINDS = frozenset({"count", "count_or_null", "size", "iteration"})
# parameter -> its kind (of _KINDS)
_PARAM_KIND = MappingProxyType(
    {
        "warmup_min_lr": "lr",
        "warmup_max_lr": "lr_or_null",
        "warmup_num_steps": "count",  # 0 allowed: DeepSpeed (and our schedules) take max(2, it); HF's default
        "warmup_type": "warmup_type",
        "total_num_steps": "size",
        "warmup_min_ratio": "ratio",
        "cos_min_ratio": "ratio",
        "lr_range_test_min_lr": "lr",
        "lr_range_test_step_size": "size",
        "lr_range_test_step_rate": "number",
        "lr_range_test_staircase": "flag",
        "cycle_min_lr": "lr",
        "cycle_max_lr": "lr",
        "decay_lr_rate": "number",
        "cycle_first_step_size": "size",
        "cycle_second_step_size": "count_or_null",
        "cycle_first_stair_count": "count",
        "cycle_second_stair_count": "count_or_null",
        "decay_step_size": "count",
        "cycle_momentum": "flag",
        "cycle_min_mom": "numbers",
        "cycle_max_mom": "numbers",
        "decay_mom_rate": "number",
        "last_batch_iteration": "iteration",
    }
)


def schedule_name(name: str, source: str = "<config>") -> str:
    """``name`` when it is a schedule of :data:`SCHEDULE_PARAMS`, or a :class:`UsageError` naming the valid ones."""
    if name not in SCHEDULE_PARAMS:
        close = difflib.get_close_matches(name, list(SCHEDULE_PARAMS), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UsageError(
            f"{source}: scheduler.type {name!r} is not a known schedule{hint} (valid: {', '.join(SCHEDULE_PARAMS)})"
        )
    return name


def _check_value(name: str, allowed: Mapping[str, Any], key: str, value: Any, source: str) -> None:
    """One ``scheduler.params`` entry: a parameter of schedule ``name`` with a value of its kind."""
    if key not in allowed:
        close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
        hint = f"did you mean 'scheduler.params.{close[0]}'? " if close else ""
        raise UsageError(
            f"{source}: unknown key 'scheduler.params.{key}' for {name}; {hint}(valid: {', '.join(allowed)})"
        )
    ok, rule = _KINDS[_PARAM_KIND[key]]
    if not ok(value):
        raise UsageError(f"{source}: scheduler.params.{key} must be {rule}, got {value!r}")


def check_schedule(name: str, params: Mapping[str, Any], source: str = "<config>") -> None:
    """Refuse an unknown schedule, an unknown or missing parameter, or a value out of range: one :class:`UsageError`
    line naming ``scheduler.type`` or ``scheduler.params.<key>`` and what it must be."""
    allowed = SCHEDULE_PARAMS[schedule_name(name, source)]
    for key, value in params.items():
        _check_value(name, allowed, key, value, source)
    missing = [k for k, d in allowed.items() if d is REQUIRED and k not in params]
    if missing:
        raise UsageError(f"{source}: {name} needs scheduler.params.{missing[0]} (add it to the scheduler's params)")


def whole_numbers(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` (checked by :func:`check_schedule`) with the whole-number parameters as ``int``."""
    return {k: (int(v) if _PARAM_KIND[k] in _WHOLE_KINDS and v is not None else v) for k, v in params.items()}
