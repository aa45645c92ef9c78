"""The tuning block (``autotuning:`` in the config, or ``--tuning FILE``) and the search space it spans.

Everything here is pure: :func:`parse_tuning` checks the block (unknown keys, an empty space, an unknown metric are
one-line :class:`UsageError` s naming the key), :func:`expand` lists the space's points at a fixed global batch
(micro batch x accumulation x world size = ``train_batch_size``) and says why any combination was left out.

Search dimensions (a list of values each; a missing one keeps the base config's value)::

    stage                 ZeRO stage 0-3
    micro_batch           samples per rank per micro-batch (accumulation follows from the global batch)
    bucket_bytes          communication bucket size
    precision             fp32 | bf16 | fp16
    prefetch              stage 3 only: all-gather the next unit ahead
    reshard_after_forward stage 3 only: free each unit after its forward
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from elasticzero.autotune.metrics import Metric, get_metric
from elasticzero.errors import UsageError

__all__ = ["DIMS", "Point", "TuningSpec", "expand", "parse_tuning"]

DIMS = ("stage", "micro_batch", "bucket_bytes", "precision", "prefetch", "reshard_after_forward")
STAGE3_ONLY = ("prefetch", "reshard_after_forward")
TUNERS = ("grid", "random", "model_based")
PRECISIONS = ("fp32", "bf16", "fp16")

#: DeepSpeed's autotuning keys that mean the same as ours
DEEPSPEED_ALIASES = {
    "tuner_type": "tuner",
    "tuner_num_trials": "max_trials",
    "tuner_early_stopping": "early_stopping",
    "exps_dir": "results_dir",
}
#: DeepSpeed's keys accepted and not used, with the reason (shown on stderr once)
DEEPSPEED_IGNORED = {
    "enabled": "the tuner runs because you started it",
    "fast": "the model-based tuner prunes by itself",
    "overwrite": "resume is the default; pass --fresh to start over",
    "start_profile_step": "use warmup_steps",
    "end_profile_step": "use measure_steps",
}
_TUNER_NAMES = {"gridsearch": "grid", "grid": "grid", "random": "random", "model_based": "model_based"}


@dataclass(frozen=True)
class TuningSpec:
    """The checked tuning block (see docs/autotuning.md for each key)."""

    metric: Metric = field(default_factory=lambda: get_metric("throughput"))
    tuner: str = "model_based"
    space: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    train_batch_size: int | None = None
    max_trials: int | None = None
    early_stopping: int | None = None
    time_budget: float | None = None  # seconds of wall time; no new experiment starts after it
    timeout: float = 600.0  # seconds per experiment
    nodes: int | None = None  # nodes per experiment (default: every node of the pool)
    slots_per_node: int | None = None  # slots per node per experiment (default: all of the node's)
    share_hosts: bool = False  # let experiments share a host's cores (timings then disturb each other)
    arg_mappings: dict[str, str] = field(default_factory=dict)
    results_dir: str = "autotuning_results"
    seed: int = 0
    warmup_steps: int = 3
    measure_steps: int = 10
    eta: int = 3  # successive halving keeps 1/eta per round
    min_steps: int = 3  # measured steps in the first round of successive halving
    noise: float = 0.01  # relative difference below which two results tie
    ignored: tuple[tuple[str, str], ...] = ()  # DeepSpeed keys accepted but unused, with the reason


_POSITIVE_INT = ("train_batch_size", "max_trials", "early_stopping", "nodes", "slots_per_node", "measure_steps")
_NONNEG_INT = ("seed", "warmup_steps")


def parse_tuning(block: Mapping[str, Any] | None, source: str) -> TuningSpec:
    """Check a tuning block; ``source`` names it in messages (``train.yaml: autotuning``)."""
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise UsageError(f"{source}: must be a mapping of keys, got {type(block).__name__}")
    known = {f.name for f in fields(TuningSpec)} - {"ignored"}
    values: dict[str, Any] = {}
    ignored = []
    for key, value in block.items():
        name = DEEPSPEED_ALIASES.get(key, key)
        if key in DEEPSPEED_IGNORED:
            ignored.append((key, DEEPSPEED_IGNORED[key]))
        elif name not in known:
            raise UsageError(f"{source}: unknown key {key!r}; known keys: {', '.join(sorted(known))}")
        else:
            values[name] = value
    return TuningSpec(**_checked(values, source), ignored=tuple(ignored))


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    out = dict(values)
    for key in _POSITIVE_INT:
        if key in out and out[key] is not None:
            out[key] = _int(out[key], f"{source}.{key}", minimum=1)
    for key in _NONNEG_INT:
        if key in out:
            out[key] = _int(out[key], f"{source}.{key}", minimum=0)
    for key in ("eta", "min_steps"):
        if key in out:
            out[key] = _int(out[key], f"{source}.{key}", minimum=2 if key == "eta" else 1)
    for key in ("time_budget", "timeout", "noise"):
        if key in out and out[key] is not None:
            out[key] = _number(out[key], f"{source}.{key}")
    if "metric" in out:
        out["metric"] = get_metric(out["metric"], f"{source}.metric")
    if "tuner" in out:
        tuner = _TUNER_NAMES.get(str(out["tuner"]))
        if tuner is None:
            raise UsageError(f"{source}.tuner: unknown tuner {out['tuner']!r}; use one of {', '.join(TUNERS)}")
        out["tuner"] = tuner
    if "space" in out:
        out["space"] = parse_space(out["space"], f"{source}.space")
    if "arg_mappings" in out:
        out["arg_mappings"] = _arg_mappings(out["arg_mappings"], f"{source}.arg_mappings")
    if "share_hosts" in out and not isinstance(out["share_hosts"], bool):
        raise UsageError(f"{source}.share_hosts: must be true or false, got {out['share_hosts']!r}")
    return out


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < minimum:
        raise UsageError(f"{where}: must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise UsageError(f"{where}: must be a number > 0, got {value!r}")
    return float(value)


def _arg_mappings(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise UsageError(f"{where}: must map config keys to script flags, e.g. {{micro_batch_size: --batch-size}}")
    for key, flag in value.items():
        if not isinstance(flag, str) or not flag.startswith("-"):
            raise UsageError(f"{where}.{key}: {flag!r} is not a flag (write e.g. --batch-size)")
    return {str(k): str(v) for k, v in value.items()}


def parse_space(space: Any, where: str) -> dict[str, tuple[Any, ...]]:
    """Each dimension's values, checked; an empty list (or space) is an error."""
    if not isinstance(space, Mapping) or not space:
        raise UsageError(f"{where}: empty search space; list values per dimension, e.g. {{stage: [1, 2, 3]}}")
    out: dict[str, tuple[Any, ...]] = {}
    for dim, values in space.items():
        if dim not in DIMS:
            raise UsageError(f"{where}: unknown dimension {dim!r}; use {', '.join(DIMS)}")
        seq = values if isinstance(values, Sequence) and not isinstance(values, str) else [values]
        if not seq:
            raise UsageError(f"{where}.{dim}: empty list; give at least one value or drop the dimension")
        out[dim] = tuple(dict.fromkeys(_dim_value(dim, v, f"{where}.{dim}") for v in seq))
    return out


def _dim_value(dim: str, value: Any, where: str) -> Any:
    if dim == "stage":
        if value not in (0, 1, 2, 3) or isinstance(value, bool):
            raise UsageError(f"{where}: ZeRO stage must be 0, 1, 2 or 3, got {value!r}")
        return int(value)
    if dim in ("micro_batch", "bucket_bytes"):
        return _int(value, where, minimum=1)
    if dim == "precision":
        if value not in PRECISIONS:
            raise UsageError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
        return value
    if not isinstance(value, bool):
        raise UsageError(f"{where}: must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, order=True)
class Point:
    """One configuration of the space (``None``: the base config's value is kept)."""

    stage: int
    micro_batch: int
    accumulation: int
    bucket_bytes: int | None = None
    precision: str | None = None
    prefetch: bool | None = None
    reshard_after_forward: bool | None = None

    @property
    def name(self) -> str:
        """A short readable name: ``z2_mb4_ga2`` plus the other set dimensions."""
        parts = [f"z{self.stage}", f"mb{self.micro_batch}", f"ga{self.accumulation}"]
        if self.bucket_bytes is not None:
            parts.append(f"bkt{self.bucket_bytes}")
        if self.precision is not None:
            parts.append(self.precision)
        if self.prefetch is not None:
            parts.append(f"pf{int(self.prefetch)}")
        if self.reshard_after_forward is not None:
            parts.append(f"rs{int(self.reshard_after_forward)}")
        return "_".join(parts)

    def memory_class(self) -> tuple[Any, ...]:
        """Every dimension except stage and micro batch: points comparable by the memory model."""
        return (self.bucket_bytes, self.precision, self.prefetch, self.reshard_after_forward)

    def values(self) -> dict[str, Any]:
        """The set dimensions (``accumulation`` included) as a mapping."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Base:
    """What the user's config says about the tuned dimensions."""

    stage: int
    micro_batch: int
    accumulation: int
    train_batch_size: int | None


def expand(spec: TuningSpec, base: Base, world_size: int) -> tuple[list[Point], list[tuple[str, str]]]:
    """The space's points (sorted) and the combinations left out, each with the reason."""
    glob = spec.train_batch_size or base.train_batch_size or base.micro_batch * base.accumulation * world_size
    dims = {d: spec.space.get(d, (None,)) for d in DIMS}
    dims["stage"] = spec.space.get("stage", (base.stage,))
    dims["micro_batch"] = spec.space.get("micro_batch", (base.micro_batch,))
    points: set[Point] = set()
    skipped: list[tuple[str, str]] = []
    for combo in itertools.product(*(dims[d] for d in DIMS)):
        v = dict(zip(DIMS, combo, strict=True))
        accum, rest = divmod(glob, v["micro_batch"] * world_size)
        if rest or accum < 1:
            why = f"global batch {glob} is not a multiple of micro batch {v['micro_batch']} x world size {world_size}"
            skipped.append((f"z{v['stage']}_mb{v['micro_batch']}", why))
            continue
        if v["stage"] != 3:
            v.update(dict.fromkeys(STAGE3_ONLY))
        points.add(Point(accumulation=accum, **v))
    if not points:
        raise UsageError(f"the search space has no usable point at global batch {glob}: {skipped[0][1]}")
    return sorted(points, key=_sort_key), list(dict.fromkeys(skipped))


def _sort_key(p: Point) -> tuple[Any, ...]:
    return tuple((v is None, str(v)) for v in (p.memory_class())) + (p.stage, p.micro_batch)
