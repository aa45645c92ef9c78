"""Writing a search-space point into the user's config, in the user's own format (native or DeepSpeed JSON).

Pure: :func:`base_of` reads the tuned values from a config mapping, :func:`apply_point` returns a new mapping with a
point's values set. The ``autotuning`` block is never copied into a trial's config, so a trial (and the final
``run``) trains with autotuning off.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from elasticzero.autotune.space import Base, Point, TuningSpec
from elasticzero.config.batch import resolve_batch_sizes
from elasticzero.config.deepspeed import looks_like_deepspeed
from elasticzero.errors import UsageError

__all__ = ["TUNING_KEY", "apply_point", "base_of", "check_expressible", "get_path", "is_deepspeed", "split_tuning"]

TUNING_KEY = "autotuning"
#: DeepSpeed's default stage-3 prefetch bucket (elements) when a point turns prefetch on
DS_PREFETCH_DEFAULT = 50_000_000


def is_deepspeed(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is a DeepSpeed ``ds_config`` (by its keys, as the config loader decides)."""
    return looks_like_deepspeed({k: v for k, v in config.items() if k != TUNING_KEY})


def split_tuning(config: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``(config without the tuning block, the block or None)``."""
    rest = {k: copy.deepcopy(v) for k, v in config.items() if k != TUNING_KEY}
    return rest, config.get(TUNING_KEY)


def get_path(config: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``a.b.c`` in nested mappings, or ``None``."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[last] = value


def base_of(config: Mapping[str, Any], deepspeed: bool, world_size: int, source: str) -> Base:
    """The stage, micro batch, accumulation and global batch the config sets, completed the way the config loader
    completes them (:func:`elasticzero.config.batch.resolve_batch_sizes`, DeepSpeed's rule)."""
    if deepspeed:
        keys = ("zero_optimization.stage", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    else:
        keys = ("zero.stage", "micro_batch_size", "accumulation_steps")
    stage, micro, accum = (get_path(config, k) for k in keys)
    train = get_path(config, "train_batch_size")
    train, micro, accum = resolve_batch_sizes(train, micro, accum, world_size, source)
    return Base(int(stage or 0), micro, accum, train)


def check_expressible(spec: TuningSpec, deepspeed: bool, source: str) -> None:
    """Reject dimensions the config format cannot carry (DeepSpeed has no reshard-after-forward key)."""
    if deepspeed and "reshard_after_forward" in spec.space:
        raise UsageError(
            f"{source}: space.reshard_after_forward has no DeepSpeed config key; drop it or use a native config"
        )


def apply_point(config: Mapping[str, Any], point: Point, deepspeed: bool, train_batch_size: int | None) -> dict:
    """A copy of ``config`` with ``point`` written in; the global batch is kept (and written when it was set)."""
    out = copy.deepcopy(dict(config))
    out.pop(TUNING_KEY, None)
    (_apply_ds if deepspeed else _apply_native)(out, point)
    if train_batch_size is not None and "train_batch_size" in config:
        out["train_batch_size"] = train_batch_size
    return out


def _apply_native(out: dict[str, Any], p: Point) -> None:
    _set(out, "zero.stage", p.stage)
    _set(out, "micro_batch_size", p.micro_batch)
    _set(out, "accumulation_steps", p.accumulation)
    if p.bucket_bytes is not None:
        _set(out, "zero.bucket_bytes", p.bucket_bytes)
    if p.precision is not None:
        _set(out, "precision.dtype", p.precision)
    if p.prefetch is not None:
        _set(out, "zero.prefetch", p.prefetch)
    if p.reshard_after_forward is not None:
        _set(out, "zero.reshard_after_forward", p.reshard_after_forward)


def _apply_ds(out: dict[str, Any], p: Point) -> None:
    _set(out, "zero_optimization.stage", p.stage)
    _set(out, "train_micro_batch_size_per_gpu", p.micro_batch)
    _set(out, "gradient_accumulation_steps", p.accumulation)
    if p.bucket_bytes is not None:  # DeepSpeed counts elements; the space counts bytes of fp32
        elements = max(1, p.bucket_bytes // 4)
        _set(out, "zero_optimization.reduce_bucket_size", elements)
        _set(out, "zero_optimization.allgather_bucket_size", elements)
    if p.precision is not None:
        _set(out, "fp16.enabled", p.precision == "fp16")
        _set(out, "bf16.enabled", p.precision == "bf16")
    if p.prefetch is not None:
        current = get_path(out, "zero_optimization.stage3_prefetch_bucket_size")
        size = current if isinstance(current, int) and current > 0 else DS_PREFETCH_DEFAULT
        _set(out, "zero_optimization.stage3_prefetch_bucket_size", size if p.prefetch else 0)
