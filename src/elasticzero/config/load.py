"""Strict loading of engine configs: YAML / JSON / hjson files in the native schema, or a DeepSpeed ``ds_config``.

::

    cfg = load_config("train.yaml", overrides=["zero.stage=3"])     # native schema (EngineConfig)
    cfg = load_config("ds_config.json")                             # DeepSpeed format, detected by its keys
    cfg, report = load_deepspeed_config("ds_config.json", strict=False)

Every problem is a :class:`~elasticzero.errors.UsageError` on one line naming the file and the key: an unknown key
(with the closest valid key suggested), a wrong type, a value out of range, contradictory batch sizes, a duplicate key
in JSON/hjson, or (DeepSpeed, ``strict=True``) every DeepSpeed key that is not supported.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elasticzero.config.auto import AutoValues, fill_auto
from elasticzero.config.batch import check_batch_sizes, resolve_world_size
from elasticzero.config.deepspeed import DeepSpeedReport, looks_like_deepspeed, map_deepspeed
from elasticzero.config.elastic import BATCH_KEYS, ElasticBatch, apply_batch_plan, check_world_range, elastic_batch
from elasticzero.config.schedules import check_schedule
from elasticzero.config.schema import EngineConfig, Precision
from elasticzero.errors import UsageError

__all__ = [
    "check_elastic_config",
    "config_from_dict",
    "load_config",
    "load_deepspeed_config",
    "load_elastic_batch",
    "optimizer_class",
    "read_file",
    "validate",
]

log = logging.getLogger(__name__)

Source = str | Path | Mapping[str, Any]


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.yaml``/``.yml`` file (omegaconf's YAML loader) or any other file as hjson (a JSON superset).

    Duplicate keys are errors (as in DeepSpeed); the top level must be a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            data = OmegaConf.to_container(OmegaConf.create(text), resolve=True) if text.strip() else {}
        except Exception as exc:  # yaml.YAMLError, omegaconf errors: one line either way
            raise UsageError(f"{path}: invalid YAML: {_one_line(exc)}") from None
    else:
        import hjson

        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except UsageError as exc:
            raise UsageError(f"{path}: {exc}") from None
        except ValueError as exc:  # hjson.HjsonDecodeError carries line/column in its message
            raise UsageError(f"{path}: invalid JSON/hjson: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return dict(data)


def load_config(
    source: Source,
    *,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
    strict: bool = True,
    format: str = "auto",
    auto: AutoValues | None = None,
) -> EngineConfig:
    """Load and validate a config file (or dict) into an :class:`EngineConfig`.

    ``format``: ``"auto"`` (DeepSpeed when a top-level key only DeepSpeed uses is present), ``"elasticzero"`` or
    ``"deepspeed"``. ``overrides``: omegaconf dotlist (``["zero.stage=3"]``) in native key names, applied last.
    ``world_size``: for batch-size checks (default: the process group, then ``$WORLD_SIZE``).
    ``strict``: DeepSpeed only; see :func:`load_deepspeed_config`.
    ``auto``: a DeepSpeed config's ``"auto"`` values filled from a front door's arguments first
    (:func:`~elasticzero.config.auto.fill_auto`; its ``world_size`` defaults to the one resolved here). Without
    it, each ``"auto"`` is reported as an unsupported key.
    """
    data, name = _read(source)
    if format not in ("auto", "elasticzero", "deepspeed"):
        raise UsageError(f"unknown config format {format!r}; use auto, elasticzero or deepspeed")
    if format == "deepspeed" or (format == "auto" and looks_like_deepspeed(data)):
        if auto is not None:
            if auto.world_size is None:
                auto = dataclasses.replace(auto, world_size=resolve_world_size(world_size))
            data = fill_auto(data, auto, source=name)
        cfg, _ = load_deepspeed_config(data, strict=strict, world_size=world_size, overrides=overrides, name=name)
        return cfg
    return config_from_dict(data, source=name, overrides=overrides, world_size=world_size)


def load_deepspeed_config(
    source: Source,
    *,
    strict: bool = True,
    world_size: int | None = None,
    overrides: Sequence[str] = (),
    name: str | None = None,
) -> tuple[EngineConfig, DeepSpeedReport]:
    """Map a DeepSpeed config (file or dict) and validate the result; returns ``(config, report)``.

    Unsupported keys (see :mod:`elasticzero.config.deepspeed`): ``strict=True`` raises one :class:`UsageError`
    naming all of them; ``strict=False`` warns (``UserWarning``) and drops them. Ignored keys are logged at INFO.
    """
    data, default_name = _read(source)
    name = name or default_name
    world = resolve_world_size(world_size)
    native, report = map_deepspeed(data, source=name, world_size=world)
    if report.unsupported:
        msg = f"{name}: unsupported DeepSpeed keys: {report.unsupported_line()}"
        if strict:
            raise UsageError(msg + " (remove them, or load with strict=False to drop them with a warning)")
        warnings.warn(msg + " (dropped)", UserWarning, stacklevel=2)
    for key, reason in report.ignored:
        log.info("%s: ignoring DeepSpeed key %s: %s", name, key, reason)
    return config_from_dict(native, source=name, overrides=overrides, world_size=world), report


def config_from_dict(
    data: Mapping[str, Any],
    *,
    source: str = "<dict>",
    overrides: Sequence[str] = (),
    world_size: int | None = None,
) -> EngineConfig:
    """Validate a native-schema mapping (plus dotlist ``overrides``) into an :class:`EngineConfig`."""
    data = _renamed(data, source)
    overrides = [_renamed_override(o) for o in overrides]
    _check_keys(data, EngineConfig, "", source)
    merged = OmegaConf.structured(EngineConfig)
    try:
        merged = OmegaConf.merge(merged, dict(data))
    except OmegaConfBaseException as exc:
        raise UsageError(_type_error(exc, source)) from None
    if overrides:
        try:
            extra = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as exc:
            raise UsageError(f"overrides {list(overrides)}: {_one_line(exc)}") from None
        assert isinstance(extra, dict)
        _check_keys({str(k): v for k, v in extra.items()}, EngineConfig, "", "overrides")
        try:
            merged = OmegaConf.merge(merged, extra)
        except OmegaConfBaseException as exc:
            raise UsageError(_type_error(exc, "overrides")) from None
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, EngineConfig)
    apply_batch_plan(cfg, _stated_batch_keys(data, overrides), resolve_world_size(world_size), source)
    validate(cfg, source=source, world_size=world_size)
    return cfg


def load_elastic_batch(source: Source) -> ElasticBatch | None:
    """The constant global batch a config (native or DeepSpeed, detected as in :func:`load_config`) asks for, or
    None; see :func:`~elasticzero.config.elastic.elastic_batch`. For launchers: no torch is imported. Keys, types and
    the elasticity block are checked; what depends on the world size or on torch (the optimizer) is left to the job.
    """
    data, name = _read(source)
    if looks_like_deepspeed(data):
        derived = _deepspeed_derived_batch(data, name)
        if derived is not None:
            return derived
        data, _ = map_deepspeed(data, source=name)  # unsupported keys: the job's strict/warn policy decides
    _check_keys(data, EngineConfig, "", name)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EngineConfig), dict(data)))
    except OmegaConfBaseException as exc:
        raise UsageError(_type_error(exc, name)) from None
    assert isinstance(cfg, EngineConfig)
    return elastic_batch(cfg, name)


def _deepspeed_derived_batch(ds: Mapping[str, Any], name: str) -> ElasticBatch | None:
    """A DeepSpeed ``train_batch_size`` whose micro batch or accumulation is derived per world (mapping it needs a
    world size): world ``W`` is valid when ``train % (micro x W) == 0``, or ``train % (accumulation x W) == 0`` when
    the micro batch is the derived one, or ``train % W == 0`` with neither (DeepSpeed's rule, as the job applies it).
    """
    elastic = ds.get("elasticity")
    if isinstance(elastic, Mapping) and elastic.get("enabled"):
        return None
    train, micro, accum = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"))  # fmt: skip
    if not isinstance(train, int) or (micro is not None and accum is not None):
        return None
    step = micro if micro is not None else accum if accum is not None else 1
    return ElasticBatch(train, (step,), source=name) if isinstance(step, int) and step >= 1 and train >= 1 else None


def check_elastic_config(source: Source, min_nodes: int, max_nodes: int, nproc_per_node: int) -> ElasticBatch | None:
    """Fail at start when ``--nnodes MIN:MAX`` x ``--nproc-per-node`` allows a world size that ``source``'s batch
    sizes cannot split (:func:`~elasticzero.config.elastic.check_world_range`); the batch checked, or None when the
    config's global batch follows the world size (every world size has a plan)."""
    batch = load_elastic_batch(source)
    if batch is not None:
        check_world_range(batch, min_nodes, max_nodes, nproc_per_node)
    return batch


def validate(cfg: EngineConfig, *, source: str = "<config>", world_size: int | None = None) -> None:
    """Range and cross-field checks that types alone cannot express; raises :class:`UsageError`."""

    def need(ok: bool, key: str, rule: str, value: Any) -> None:
        if not ok:
            raise UsageError(f"{source}: {key} {rule}, got {value!r}")

    z = cfg.zero
    need(z.stage in (0, 1, 2, 3), "zero.stage", "must be 0, 1, 2 or 3", z.stage)
    need(z.bucket_bytes is None or z.bucket_bytes > 0, "zero.bucket_bytes", "must be > 0 (or null)", z.bucket_bytes)
    need(z.copies.node_shift >= 1, "zero.copies.node_shift", "must be >= 1", z.copies.node_shift)
    _check_offload(z, need)
    ls = cfg.precision.loss_scale
    need(ls.init_scale > 0, "precision.loss_scale.init_scale", "must be > 0", ls.init_scale)
    need(ls.growth_factor > 1, "precision.loss_scale.growth_factor", "must be > 1", ls.growth_factor)
    need(0 < ls.backoff_factor < 1, "precision.loss_scale.backoff_factor", "must be in (0, 1)", ls.backoff_factor)
    need(ls.growth_interval >= 1, "precision.loss_scale.growth_interval", "must be >= 1", ls.growth_interval)
    need(ls.hysteresis >= 1, "precision.loss_scale.hysteresis", "must be >= 1", ls.hysteresis)
    need(
        0 < ls.min_scale <= ls.init_scale,
        "precision.loss_scale.min_scale",
        f"must be in (0, init_scale={ls.init_scale:g}]",
        ls.min_scale,
    )
    need(cfg.clip_grad_norm >= 0, "clip_grad_norm", "must be >= 0 (0 = no clipping)", cfg.clip_grad_norm)
    need(cfg.accumulation_steps >= 1, "accumulation_steps", "must be >= 1", cfg.accumulation_steps)
    need(cfg.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", cfg.micro_batch_size)
    tbs = cfg.train_batch_size
    need(tbs is None or tbs >= 1, "train_batch_size", "must be >= 1", tbs)
    if cfg.elasticity.enabled:
        elastic_batch(cfg, source)  # checks the block and that some world size has a plan
    cls = optimizer_class(cfg.optimizer.type, source)
    _check_optimizer_params(cls, cfg.optimizer.params, source)
    if cfg.scheduler.type is not None:
        check_schedule(cfg.scheduler.type, cfg.scheduler.params, source)
    elif cfg.scheduler.params:
        raise UsageError(f"{source}: scheduler.params is set without scheduler.type: name the schedule (or drop them)")
    check_batch_sizes(
        cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps, resolve_world_size(world_size), source
    )
    if cfg.precision.dtype is not Precision.fp16 and ls.enabled:
        log.info("%s: loss scaling is on with %s (only fp16 needs it)", source, cfg.precision.dtype.value)


def _check_offload(z: Any, need: Any) -> None:
    """``zero.offload``: a ZeRO stage to offload from, ``params`` on stage 3 with ``optimizer``, ranges."""
    off = z.offload
    need(0.0 <= off.ratio <= 1.0, "zero.offload.ratio", "must be in [0, 1]", off.ratio)
    budget = off.device_budget_bytes
    need(budget is None or budget >= 0, "zero.offload.device_budget_bytes", "must be >= 0 (or null)", budget)
    if off.optimizer or off.params:
        need(z.stage in (1, 2, 3), "zero.offload", "needs a ZeRO stage (1-3) to offload from; zero.stage", z.stage)
    if off.params:
        need(
            z.stage == 3,
            "zero.offload.params",
            "is for ZeRO stage 3 only (stages 1/2 keep whole parameters on the device): drop it or use stage 3; "
            "zero.stage",
            z.stage,
        )
        need(
            off.optimizer,
            "zero.offload.params",
            "needs zero.offload.optimizer: true (in ZeRO-3 the parameter shards are the fp32 masters the optimizer "
            "steps); zero.offload.optimizer",
            off.optimizer,
        )


def optimizer_class(name: str, source: str = "<config>") -> type:
    """The ``torch.optim`` optimizer class called ``name`` (case-insensitive), or a :class:`UsageError`."""
    import torch.optim

    classes = {
        n: c
        for n in dir(torch.optim)
        if isinstance(c := getattr(torch.optim, n), type) and issubclass(c, torch.optim.Optimizer)
        if c is not torch.optim.Optimizer
    }
    by_lower = {n.lower(): c for n, c in classes.items()}
    cls = by_lower.get(name.lower())
    if cls is None:
        raise UsageError(f"{source}: optimizer.type {name!r} is not a torch.optim optimizer{_suggest(name, classes)}")
    return cls


# ------------------------------------------------------------------------------------------------ helpers
#: renamed blocks of the native schema: old key -> new key (the old one is still read, files and overrides alike)
RENAMED = {"zero.replicas": "zero.copies"}


def _renamed(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``data`` with every block under an old name of :data:`RENAMED` moved to its new name (one line naming both
    when a config gives both)."""
    out = dict(data)
    for old, new in RENAMED.items():
        (section, old_key), new_key = old.split("."), new.split(".")[1]
        block = out.get(section)
        if not isinstance(block, Mapping) or old_key not in block:
            continue
        if new_key in block:
            raise UsageError(f"{source}: '{old}' is the old name of '{new}'; give only '{new}'")
        out[section] = {(new_key if k == old_key else k): v for k, v in block.items()}
    return out


def _renamed_override(override: str) -> str:
    """A dotlist override under an old name of :data:`RENAMED`, under the new one."""
    for old, new in RENAMED.items():
        if override.startswith((f"{old}.", f"{old}=")):
            return new + override[len(old) :]
    return override


def _stated_batch_keys(data: Mapping[str, Any], overrides: Sequence[str]) -> set[str]:
    """Batch keys the user stated. An override of the global or micro batch re-derives the file's accumulation."""
    named = {o.split("=", 1)[0].strip() for o in overrides} & set(BATCH_KEYS)
    stated = (set(data) & set(BATCH_KEYS)) | named
    if named & {"train_batch_size", "micro_batch_size"} and "accumulation_steps" not in named:
        stated.discard("accumulation_steps")
    return stated


def _read(source: Source) -> tuple[dict[str, Any], str]:
    if isinstance(source, Mapping):
        return dict(source), "<dict>"
    return read_file(source), str(source)


def _check_keys(data: Mapping[str, Any], cls: type, prefix: str, source: str) -> None:
    """Unknown keys against the dataclass tree, with the closest valid key suggested."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise UsageError(
                f"{source}: unknown key '{path}'{_suggest(str(key), names, prefix)} (valid here: {', '.join(names)})"
            )
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            if not isinstance(value, Mapping):
                raise UsageError(f"{source}: '{path}' must be a mapping of keys, got {value!r}")
            _check_keys(value, sub, f"{path}.", source)  # type: ignore[arg-type]


def _check_optimizer_params(cls: type, params: Mapping[str, Any], source: str) -> None:
    sig = inspect.signature(cls)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    allowed = [n for n in sig.parameters if n not in ("self", "params")]
    for key in params:
        if key not in allowed:
            raise UsageError(
                f"{source}: unknown key 'optimizer.params.{key}' for torch.optim.{cls.__name__}"
                f"{_suggest(str(key), allowed, 'optimizer.params.')}"
            )


def _suggest(key: str, candidates: Sequence[str] | Mapping[str, Any], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
        close = [lowered[c] for c in close]
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _type_error(exc: OmegaConfBaseException, source: str) -> str:
    key = getattr(exc, "full_key", None)
    msg = getattr(exc, "msg", None) or str(exc)
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    if key:
        return f"{source}: wrong type for '{key}': {first}"
    return f"{source}: {first}"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise UsageError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
