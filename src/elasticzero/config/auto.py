"""Fill a DeepSpeed config's ``"auto"`` values from a front door's (or a script's) own arguments.

The Hugging Face Trainer hands out ``ds_config.json`` files with ``"auto"`` where its ``TrainingArguments`` decide
(``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``); this is the same rule, pure::

    values = AutoValues(world_size=8, micro_batch_size=4, accumulation_steps=2, lr=3e-4, weight_decay=0.1,
                        clip_grad_norm=1.0, bf16=True, warmup_steps=100, total_steps=5000)
    cfg = load_config("ds_config_zero2.json", auto=values)          # or build_pieces(model, path, auto=values)
    filled = fill_auto(read_file("ds_config_zero2.json"), values)    # the filled dict itself

Each key of :data:`AUTO_KEYS` that is ``"auto"`` in the config and has a value here is replaced by it. A key with a
value here that the config states as something else is a mismatch (the Trainer's rule: one
:class:`~elasticzero.errors.UsageError` line naming every one; ``check=False`` leaves stated values alone), except
``scheduler.params.warmup_min_lr`` and the ``zero_optimization`` sizes, which are only filled. A key missing from the
config is not added, and an ``"auto"`` with no value here stays: loading names it.

A native (elasticzero YAML) config has no ``"auto"``: :func:`fill_native` applies the same rule to what it leaves
out — each key of :data:`NATIVE_KEYS` the config does not state is taken from the arguments, one it states must agree
(the optimizer's ``betas``/``eps`` only for an Adam-family optimizer; ``precision.dtype`` only when the arguments ask
for bf16 or fp16).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticzero.errors import UsageError

__all__ = ["AUTO_KEYS", "NATIVE_KEYS", "AutoValues", "fill_auto", "fill_native"]


@dataclass(frozen=True)
class AutoValues:
    """A front door's arguments, in the Trainer's terms (``None``: not known, leave that ``"auto"``)."""

    world_size: int | None = None  # with micro batch and accumulation: train_batch_size = their product
    micro_batch_size: int | None = None  # per_device_train_batch_size
    accumulation_steps: int | None = None  # gradient_accumulation_steps
    lr: float | None = None  # learning_rate: optimizer.params.lr and scheduler.params.warmup_max_lr
    betas: tuple[float, float] | None = None  # (adam_beta1, adam_beta2)
    eps: float | None = None  # adam_epsilon
    weight_decay: float | None = None
    clip_grad_norm: float | None = None  # max_grad_norm -> gradient_clipping
    fp16: bool | None = None
    bf16: bool | None = None
    warmup_steps: int | None = None  # scheduler.params.warmup_num_steps (the Trainer's get_warmup_steps)
    total_steps: int | None = None  # scheduler.params.total_num_steps (the Trainer's max_steps)
    warmup_min_lr: float | None = 0.0  # scheduler.params.warmup_min_lr: the Trainer fills 0 (not one of its arguments)
    hidden_size: int | None = None  # the model's: the zero_optimization bucket sizes the Trainer derives from it


def _train_batch(v: AutoValues, cfg: Mapping[str, Any]) -> int | None:
    """world x micro x accumulation, each from ``v`` or else stated as a number in the config."""
    micro = v.micro_batch_size if v.micro_batch_size is not None else _number(cfg.get("train_micro_batch_size_per_gpu"))
    accum = (
        v.accumulation_steps if v.accumulation_steps is not None else _number(cfg.get("gradient_accumulation_steps"))
    )
    if v.world_size is None or micro is None or accum is None:
        return None
    return int(v.world_size * micro * accum)


def _stage3(cfg: Mapping[str, Any]) -> bool:
    zero = cfg.get("zero_optimization")
    return isinstance(zero, Mapping) and zero.get("stage") == 3


def _square(v: AutoValues, factor: float = 1.0) -> int | None:
    return None if v.hidden_size is None else int(factor * v.hidden_size * v.hidden_size)


_Value = Callable[[AutoValues, Mapping[str, Any]], Any]

# dotted DeepSpeed key -> (its value from the arguments or None, a stated other value is a mismatch)
AUTO_KEYS: dict[str, tuple[_Value, bool]] = {
    "train_micro_batch_size_per_gpu": (lambda v, c: v.micro_batch_size, True),
    "gradient_accumulation_steps": (lambda v, c: v.accumulation_steps, True),
    "train_batch_size": (_train_batch, True),
    "gradient_clipping": (lambda v, c: v.clip_grad_norm, True),
    "optimizer.params.lr": (lambda v, c: v.lr, True),
    "optimizer.params.betas": (lambda v, c: None if v.betas is None else list(v.betas), True),
    "optimizer.params.eps": (lambda v, c: v.eps, True),
    "optimizer.params.weight_decay": (lambda v, c: v.weight_decay, True),
    "scheduler.params.warmup_min_lr": (lambda v, c: v.warmup_min_lr, False),
    "scheduler.params.warmup_max_lr": (lambda v, c: v.lr, True),
    "scheduler.params.warmup_num_steps": (lambda v, c: v.warmup_steps, True),
    "scheduler.params.total_num_steps": (lambda v, c: v.total_steps, True),
    "fp16.enabled": (lambda v, c: v.fp16, True),
    "bf16.enabled": (lambda v, c: v.bf16, True),
    "zero_optimization.reduce_bucket_size": (lambda v, c: _square(v), False),
    "zero_optimization.stage3_prefetch_bucket_size": (lambda v, c: _square(v, 0.9) if _stage3(c) else None, False),
    "zero_optimization.stage3_param_persistence_threshold": (
        lambda v, c: None if v.hidden_size is None or not _stage3(c) else 10 * v.hidden_size,
        False,
    ),
}


def fill_auto(
    config: Mapping[str, Any], values: AutoValues, *, check: bool = True, source: str = "<dict>"
) -> dict[str, Any]:
    """A copy of the DeepSpeed ``config`` with its ``"auto"`` values filled from ``values`` (the module docstring
    has the rule); ``config`` itself is not changed. ``source`` names the config in the mismatch error."""
    filled = copy.deepcopy(dict(config))
    mismatches = []
    for key, (value_of, must_match) in AUTO_KEYS.items():
        node, leaf = _node(filled, key)
        if node is None or leaf not in node:
            continue
        value = value_of(values, config)
        if value is None:
            continue
        if is_auto(node[leaf]):
            node[leaf] = value
        elif check and must_match and not _same(node[leaf], value):
            mismatches.append(f"{key} is {node[leaf]!r} but the arguments say {value!r}")
    if mismatches:
        raise UsageError(
            f"{source}: the config disagrees with the arguments: {'; '.join(mismatches)} "
            '(set those keys to "auto" to take the arguments, or make them agree; check=False keeps the config\'s)'
        )
    return filled


def is_auto(value: Any) -> bool:
    """DeepSpeed's placeholder: the string ``"auto"`` (any case, surrounding blanks ignored)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def _node(cfg: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    """The mapping holding the last part of dotted ``key`` and that part; None when a parent is missing."""
    *parents, leaf = key.split(".")
    node: Any = cfg
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _same(stated: Any, value: Any) -> bool:
    if isinstance(stated, (list, tuple)) and isinstance(value, (list, tuple)):
        return list(stated) == list(value)
    return bool(stated == value)


def _number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _adam(cfg: Mapping[str, Any]) -> bool:
    """Whether the native config's optimizer takes ``betas``/``eps`` (its type absent: AdamW, the default)."""
    opt = cfg.get("optimizer")
    kind = opt.get("type", "AdamW") if isinstance(opt, Mapping) else "AdamW"
    return isinstance(kind, str) and "adam" in kind.lower()


def _dtype(v: AutoValues) -> str | None:
    return "bf16" if v.bf16 else "fp16" if v.fp16 else None


# dotted native key -> its value from the arguments, or None (not known, or the key does not apply to this config)
NATIVE_KEYS: dict[str, _Value] = {
    "micro_batch_size": lambda v, c: v.micro_batch_size,
    "accumulation_steps": lambda v, c: v.accumulation_steps,
    "train_batch_size": lambda v, c: _train_batch(v, {}),
    "clip_grad_norm": lambda v, c: v.clip_grad_norm,
    "optimizer.params.lr": lambda v, c: v.lr,
    "optimizer.params.betas": lambda v, c: None if v.betas is None or not _adam(c) else list(v.betas),
    "optimizer.params.eps": lambda v, c: v.eps if _adam(c) else None,
    "optimizer.params.weight_decay": lambda v, c: v.weight_decay,
    "precision.dtype": lambda v, c: _dtype(v),
}


def fill_native(config: Mapping[str, Any], values: AutoValues, *, source: str = "<dict>") -> dict[str, Any]:
    """A copy of the native ``config`` with each key of :data:`NATIVE_KEYS` it leaves out taken from ``values``; a
    stated key that disagrees is a mismatch (one :class:`~elasticzero.errors.UsageError` line naming every one)."""
    filled = copy.deepcopy(dict(config))
    mismatches = []
    for key, value_of in NATIVE_KEYS.items():
        value = value_of(values, config)
        if value is None:
            continue
        node, leaf = _node_made(filled, key, source)
        if leaf not in node:
            node[leaf] = value
        elif not _same(node[leaf], value):
            mismatches.append(f"{key} is {node[leaf]!r} but the arguments say {value!r}")
    if mismatches:
        raise UsageError(
            f"{source}: the config disagrees with the arguments: {'; '.join(mismatches)} "
            "(leave those keys out to take the arguments, or make them agree)"
        )
    return filled


def _node_made(cfg: dict[str, Any], key: str, source: str) -> tuple[dict[str, Any], str]:
    """The mapping that holds the last part of dotted ``key`` (missing parents made) and that part."""
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UsageError(f"{source}: {key.rsplit('.', 1)[0]} must be a mapping, got {type(node).__name__}")
    return node, leaf
