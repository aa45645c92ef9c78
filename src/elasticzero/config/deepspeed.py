"""DeepSpeed ``ds_config.json`` → elasticzero config mapping, with a report of every key it did not map.

:func:`map_deepspeed` turns a DeepSpeed config dict into a native config dict (the shape of
:class:`~elasticzero.config.schema.EngineConfig`) plus a :class:`DeepSpeedReport`. Every DeepSpeed key lands in exactly
one of three lists:

* ``mapped``: translated (``zero_optimization.stage`` → ``zero.stage``, ...);
* ``ignored``: known keys that do not change the training result here (logging, monitors, DeepSpeed-internal
  performance knobs such as ``overlap_comm``, offload set to ``"none"``, NVMe swap sizes with CPU offload). Never an
  error;
* ``unsupported``: keys that would change training if honoured (NVMe offload, ``torch_autocast``, ...),
  ``"auto"`` values left unfilled (:func:`elasticzero.config.auto.fill_auto` fills them from a front door's or a
  script's own arguments; or write the number), and keys DeepSpeed does not know
  either (typos: DeepSpeed silently ignores them; a close known key is suggested).

Policy: with ``strict=True`` (the default) :func:`elasticzero.config.load.load_config` raises one
:class:`~elasticzero.errors.UsageError` naming every unsupported key; ``strict=False`` drops them with a warning.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticzero.config.batch import resolve_batch_sizes
from elasticzero.config.schema import EngineConfig
from elasticzero.errors import UsageError

__all__ = ["DeepSpeedReport", "key_verdicts", "looks_like_deepspeed", "map_deepspeed"]

_MONITOR = "monitoring/logging: log from your own loop"

# top-level keys that never change the result here: key -> reason
_IGNORED_TOP: dict[str, str] = {
    "steps_per_print": _MONITOR,
    "dump_state": _MONITOR,
    "tensorboard": _MONITOR,
    "wandb": _MONITOR,
    "csv_monitor": _MONITOR,
    "comet": _MONITOR,
    "flops_profiler": _MONITOR,
    "comms_logger": _MONITOR,
    "memory_breakdown": _MONITOR,
    "zero_allow_untested_optimizer": "every torch.optim optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "DeepSpeed's CPU Adam is not used (offload steps with torch's fused CPU AdamW)",
    "dataloader_drop_last": "applies to DeepSpeed's own data loader only",
    "checkpoint": "DeepSpeed checkpoint options do not apply: save weights with opt.full_state_dict()",
    "aio": "NVMe offload I/O (NVMe offload is refused; CPU offload needs none)",
    "seq_parallel_communication_data_type": "sequence parallelism is not used",
    "autotuning": "read by elasticzero-autotune / elasticzero-launch --autotuning, not by the training run",
    "timers": _MONITOR,
    "log_level": _MONITOR,
    "disable_python_gc": "DeepSpeed's garbage-collection pacing (checkpoint I/O pauses automatic GC here)",
    "managed_gradient_accumulation": "your loop owns the accumulation boundary (pieces.accumulation.advance())",
    "datastates_ckpt": "DeepSpeed's DataStates checkpoint engine: checkpoints go through elasticzero.checkpoint",
}

# top-level DeepSpeed features that would change training: key -> what to do instead
_UNSUPPORTED_TOP: dict[str, str] = {
    "torch_autocast": "wrap the forward in torch.autocast yourself",
    "amp": "use precision.dtype",
    "data_types": "gradients accumulate in fp32 unless precision.reduce_in_low_precision",
    "pipeline": "pipeline parallelism is not provided",
    "compile": "call torch.compile on the model yourself",
    "data_efficiency": "not provided",
    "curriculum_learning": "not provided",
    "compression_training": "not provided",
    "sparse_attention": "not provided",
    "sparse_gradients": "not provided",
    "hybrid_engine": "not provided",
    "tensor_parallel": "not provided",
    "sequence_parallel_size": "not provided",
    "expert_parallel": "not provided",
    "quantize_training": "not provided",
    "weight_quantization": "not provided",
    "eigenvalue": "not provided",
    "progressive_layer_drop": "not provided",
    "nebula": "not provided",
    "graph_harvesting": "not provided",
    "gradient_allreduce_op": "gradients are averaged",
}

# keys whose value decides: None = harmless (ignored), else the unsupported reason
_Check = Callable[[Any], "str | None"]


def _only(harmless: Any, reason: str) -> _Check:
    return lambda v: None if v == harmless else reason


_CONDITIONAL_TOP: dict[str, _Check] = {
    "prescale_gradients": _only(False, "gradients are averaged after the reduction only"),
    "gradient_predivide_factor": _only(1.0, "gradients are averaged after the reduction only"),
    "disable_allgather": _only(False, "the parameter all-gather is part of the algorithm"),
    "use_data_before_expert_parallelism": _only(False, "expert parallelism is not provided"),
}

_ZERO_MAPPED = {"stage", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"}
_ZERO_IGNORED: dict[str, str] = {
    **dict.fromkeys(
        (
            "overlap_comm",
            "contiguous_gradients",
            "reduce_scatter",
            "allgather_partitions",
            "round_robin_gradients",
            "use_multi_rank_bucket_allreduce",
            "sub_group_size",
            "ignore_unused_parameters",
            "legacy_stage1",
            "memory_efficient_linear",
            "log_trace_cache_warnings",
        ),
        "DeepSpeed-internal performance knob; elasticzero's reduction has the same result",
    ),
    **dict.fromkeys(
        (
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_param_persistence_threshold",
            "stage3_module_granularity_threshold",
        ),
        "stage 3 gathers each submodule's parameters and frees them after use",
    ),
    **dict.fromkeys(
        ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
        "use opt.full_state_dict() to save full weights",
    ),
    **dict.fromkeys(
        ("elastic_checkpoint", "load_from_fp32_weights"),
        "no DeepSpeed checkpoints: opt.load_full_state_dict() loads fp32 weights at any world size",
    ),
    **dict.fromkeys(
        (
            "stage3_model_persistence_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "parameter_alignment",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "enable_sanity_checks",
            "leaf_module",
        ),
        "DeepSpeed-internal layout or fetch knob; stage 3 gathers per unit (ZeroStage3(units=...))",
    ),
    "compute_grad_norm": "the norm is computed when clipping needs it",
    "save_muon_momentum_buffer_in_memory": "DeepSpeed's Muon optimizer only (no torch equivalent)",
}
_ZERO_CONDITIONAL: dict[str, _Check] = {
    "zero_hpz_partition_size": _only(1, "hierarchical partitioning (ZeRO++) is not provided"),
    "zero_quantized_weights": _only(False, "quantized communication (ZeRO++) is not provided"),
    "zero_quantized_nontrainable_weights": _only(False, "quantized communication (ZeRO++) is not provided"),
    "zero_quantized_gradients": _only(False, "quantized communication (ZeRO++) is not provided"),
    "mics_shard_size": lambda v: None if v is None or v <= 0 else "MiCS sharding is not provided",
    "zenflow": _only(None, "ZenFlow's stale updates of unimportant gradients change training: not provided"),
}

_OFFLOAD_BLOCKS = {"offload_optimizer": "optimizer", "offload_param": "params"}
_OFFLOAD_LEGACY = {  # DeepSpeed's deprecated booleans -> zero.offload field
    "cpu_offload": "optimizer",
    "cpu_offload_params": "params",
    "cpu_offload_use_pin_memory": "pin_memory",
}
_NVME_ONLY = "NVMe swap setting (ZeRO-Infinity): no effect with device cpu, as in DeepSpeed"
_OFFLOAD_IGNORED: dict[str, str] = {
    **dict.fromkeys(
        (
            "nvme_path",
            "nvme_path_per_local_rank",
            "buffer_count",
            "buffer_size",
            "max_in_cpu",
            "pipeline_read",
            "pipeline_write",
            "fast_init",
        ),
        _NVME_ONLY,
    ),
    "super_offload": "DeepSpeed's Superchip scheduling; here the host step overlaps backward (step_in_backward)",
    "cpuadam_cores_perc": "the host step runs on torch's intra-op threads (torch.set_num_threads)",
}
_NVME_REFUSED = (
    "NVMe offload (ZeRO-Infinity) is not provided: use device: cpu (host memory); if host memory is short, keep part "
    "of the state on the device with offload_optimizer.ratio < 1"
)

_FP16_MAPPED = {
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
}
_FP16_CONDITIONAL: dict[str, _Check] = {
    "auto_cast": _only(False, "inputs are not cast: wrap the forward in torch.autocast yourself"),
    "fp16_master_weights_and_grads": _only(False, "master weights are always fp32"),
}
_BF16_CONDITIONAL: dict[str, _Check] = {
    "immediate_grad_update": lambda v: None,
    "check_grad_overflow": _only(False, "bf16 runs without overflow checks (use fp16 + loss scaling for that)"),
    "bf16_master_weights_and_grads": _only(False, "master weights are always fp32"),
    "bf16_optimizer_states": _only(False, "optimizer state is always fp32"),
}

_MAPPED_TOP = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "wall_clock_breakdown",
    "communication_data_type",
    "elasticity",
    "activation_checkpointing",
    "scheduler",
}
# only these say "DeepSpeed": not the native schema's own top-level keys ("optimizer", "scheduler", "timers",
# "train_batch_size", "elasticity", "activation_checkpointing", ...), which a native file uses too
_DEEPSPEED_ONLY_TOP = {*_MAPPED_TOP, *_IGNORED_TOP, *_UNSUPPORTED_TOP, *_CONDITIONAL_TOP} - {
    f.name for f in dataclasses.fields(EngineConfig)
}

# DeepSpeed optimizer "type" (lower case) -> torch.optim class name; "adam" is AdamW unless adam_w_mode is false
_OPTIMIZERS = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
_OPTIMIZER_PARAMS_IGNORED = {"torch_adam": "torch's optimizer is always used", "fused": "a torch.optim keyword"}


@dataclass
class DeepSpeedReport:
    """What happened to every DeepSpeed key (dotted paths)."""

    source: str
    mapped: list[tuple[str, str]] = field(default_factory=list)  # (DeepSpeed key, elasticzero key)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (DeepSpeed key, why it does not matter)
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (DeepSpeed key, why / what to do instead)

    def format(self) -> str:
        """A human-readable multi-line summary."""
        lines = [f"{self.source}: DeepSpeed config"]
        lines += [f"  mapped      {k} -> {v}" for k, v in self.mapped]
        lines += [f"  ignored     {k}: {v}" for k, v in self.ignored]
        lines += [f"  unsupported {k}: {v}" for k, v in self.unsupported]
        return "\n".join(lines)

    def unsupported_line(self) -> str:
        """All unsupported keys on one line (the strict-mode error)."""
        return "; ".join(f"{k} ({v})" for k, v in self.unsupported)


def looks_like_deepspeed(d: Mapping[str, Any]) -> bool:
    """True when a top-level key exists only in DeepSpeed's vocabulary (``zero_optimization``, ``fp16``, ...)."""
    return any(k in _DEEPSPEED_ONLY_TOP for k in d)


def map_deepspeed(
    ds: Mapping[str, Any], *, source: str = "<deepspeed config>", world_size: int | None = None
) -> tuple[dict[str, Any], DeepSpeedReport]:
    """Translate a DeepSpeed config dict; returns ``(native config dict, report)``.

    Raises :class:`UsageError` only for values that cannot be mapped at all (``fp16`` and ``bf16`` both enabled,
    an optimizer type with no torch equivalent, contradictory batch sizes, a bucket size that is not a whole number).
    Unsupported keys are only *reported* here; the loader applies the strict/warn policy.
    """
    rep = DeepSpeedReport(source)
    out: dict[str, Any] = {}
    ds = _drop_auto(ds, "", rep)

    for key, value in ds.items():
        if key in _MAPPED_TOP:
            continue
        if key in _IGNORED_TOP:
            rep.ignored.append((key, _IGNORED_TOP[key]))
        elif key in _UNSUPPORTED_TOP:
            rep.unsupported.append((key, _UNSUPPORTED_TOP[key]))
        elif key in _CONDITIONAL_TOP:
            _classify(rep, key, _CONDITIONAL_TOP[key](value), "harmless value")
        else:
            rep.unsupported.append((key, _unknown(key, _MAPPED_TOP | _DEEPSPEED_ONLY_TOP)))

    precision = _map_precision(ds, out, rep, source)
    _map_zero(ds.get("zero_optimization"), out, rep, source, precision)
    _map_optimizer(ds.get("optimizer"), out, rep, source)
    _map_scheduler(ds.get("scheduler"), out, rep, source)

    if "gradient_clipping" in ds:
        out["clip_grad_norm"] = ds["gradient_clipping"]
        rep.mapped.append(("gradient_clipping", "clip_grad_norm"))
    if "wall_clock_breakdown" in ds:
        out["timers"] = {"enabled": ds["wall_clock_breakdown"]}
        rep.mapped.append(("wall_clock_breakdown", "timers.enabled"))

    _map_activation_checkpointing(ds.get("activation_checkpointing"), out, rep, source)

    if _map_elasticity(ds.get("elasticity"), out, rep, source):
        _drop_non_elastic_batch_keys(ds, rep, source)
        return out, rep
    train = _maybe_whole(ds.get("train_batch_size"), "train_batch_size", source)
    micro = _maybe_whole(ds.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu", source)
    accum = _maybe_whole(ds.get("gradient_accumulation_steps"), "gradient_accumulation_steps", source)
    train, micro, accum = resolve_batch_sizes(train, micro, accum, world_size, source)
    out.update(micro_batch_size=micro, accumulation_steps=accum)
    if "train_batch_size" in ds:  # a derived global batch would pin the world size: keep only a stated one
        out["train_batch_size"] = train
    for ds_key, ez_key in (
        ("train_batch_size", "train_batch_size"),
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
        ("gradient_accumulation_steps", "accumulation_steps"),
    ):
        if ds_key in ds:
            rep.mapped.append((ds_key, ez_key))
    return out, rep


# ------------------------------------------------------------------------------------------------ pieces
def _map_precision(ds: Mapping[str, Any], out: dict[str, Any], rep: DeepSpeedReport, source: str) -> str:
    fp16 = _block(ds, "fp16", source)
    bf16 = _block(ds, "bf16" if "bf16" in ds else "bfloat16", source)  # "bfloat16": DeepSpeed's old name
    fp16_on, bf16_on = bool(fp16.get("enabled", False)), bool(bf16.get("enabled", False))
    if fp16_on and bf16_on:
        raise UsageError(f"{source}: fp16.enabled and bf16.enabled are both true; enable one of them")
    dtype = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    precision: dict[str, Any] = {"dtype": dtype}

    for key, value in fp16.items():
        path = f"fp16.{key}"
        if key in _FP16_CONDITIONAL:
            _classify(rep, path, _FP16_CONDITIONAL[key](value), "harmless value")
        elif key not in _FP16_MAPPED:
            rep.unsupported.append((path, _unknown(key, _FP16_MAPPED | set(_FP16_CONDITIONAL), "fp16.")))
        elif key != "enabled" and not fp16_on:
            rep.ignored.append((path, "fp16 is not enabled"))
    for key, value in bf16.items():
        path = f"bf16.{key}"
        if key in _BF16_CONDITIONAL:
            _classify(rep, path, _BF16_CONDITIONAL[key](value), "harmless value")
        elif key != "enabled":
            rep.unsupported.append((path, _unknown(key, {"enabled", *_BF16_CONDITIONAL}, "bf16.")))
    if "enabled" in fp16:
        rep.mapped.append(("fp16.enabled", "precision.dtype"))
    if "enabled" in bf16:
        rep.mapped.append(("bf16.enabled", "precision.dtype"))

    if fp16_on:
        scale: dict[str, Any] = {}
        loss_scale = fp16.get("loss_scale", 0)
        if loss_scale:  # a fixed scale
            scale.update(dynamic=False, init_scale=float(loss_scale), min_scale=min(1.0, float(loss_scale)))
            rep.mapped.append(("fp16.loss_scale", "precision.loss_scale.dynamic=false, init_scale"))
        else:
            if "loss_scale" in fp16:
                rep.mapped.append(("fp16.loss_scale", "precision.loss_scale.dynamic=true"))
            if "initial_scale_power" in fp16:
                scale["init_scale"] = 2.0 ** _whole(fp16["initial_scale_power"], "fp16.initial_scale_power", source)
                rep.mapped.append(("fp16.initial_scale_power", "precision.loss_scale.init_scale (2**power)"))
        for ds_key, ez_key in (
            ("loss_scale_window", "growth_interval"),
            ("hysteresis", "hysteresis"),
            ("consecutive_hysteresis", "consecutive_hysteresis"),
            ("min_loss_scale", "min_scale"),
        ):
            if ds_key in fp16:
                scale[ez_key] = fp16[ds_key]
                rep.mapped.append((f"fp16.{ds_key}", f"precision.loss_scale.{ez_key}"))
        precision["loss_scale"] = scale

    if "communication_data_type" in ds:
        comm = str(ds["communication_data_type"]).lower()
        if comm == "fp32":
            precision["reduce_in_low_precision"] = False
        elif comm == dtype:
            precision["reduce_in_low_precision"] = True
        else:
            rep.unsupported.append(
                ("communication_data_type", f"gradients reduce in fp32 or in the compute dtype ({dtype}), not {comm}")
            )
        if comm in ("fp32", dtype):
            rep.mapped.append(("communication_data_type", "precision.reduce_in_low_precision"))
    out["precision"] = precision
    return dtype


# DeepSpeed's activation_checkpointing block configures deepspeed.checkpointing.checkpoint where a model calls it; here
# the block's presence is the call: the model's repeated blocks are checkpointed (torch.utils.checkpoint)
_ACT_CKPT_MAPPED = {"cpu_checkpointing": "activation_checkpointing.cpu (torch.autograd.graph.save_on_cpu)"}
_ACT_CKPT_IGNORED: dict[str, str] = {
    "partition_activations": "splits each checkpoint over model-parallel ranks: without model parallelism every rank "
    "keeps its own, as DeepSpeed does at model-parallel size 1",
    "contiguous_memory_optimization": "copies the checkpoints into one preallocated buffer against fragmentation "
    "(memory layout only; torch's caching allocator holds them)",
    "number_checkpoints": "sizes DeepSpeed's contiguous buffer; the blocks are found in the model "
    "(activation_checkpointing.blocks names their class)",
    "synchronize_checkpoint_boundary": "a device synchronize around every checkpoint, for timing",
    "profile": _MONITOR,
}


def _map_activation_checkpointing(block: Any, out: dict[str, Any], rep: DeepSpeedReport, source: str) -> None:
    """DeepSpeed's ``activation_checkpointing`` block -> ``activation_checkpointing`` (enabled by its presence)."""
    if block is None:
        return
    if not isinstance(block, Mapping):
        raise UsageError(f"{source}: activation_checkpointing must be a mapping, got {type(block).__name__}")
    mapped: dict[str, Any] = {"enabled": True}
    rep.mapped.append(("activation_checkpointing", "activation_checkpointing.enabled (the model's repeated blocks)"))
    for key, value in block.items():
        path = f"activation_checkpointing.{key}"
        if key == "cpu_checkpointing":
            mapped["cpu"] = value
            rep.mapped.append((path, _ACT_CKPT_MAPPED[key]))
        elif key in _ACT_CKPT_IGNORED:
            rep.ignored.append((path, _ACT_CKPT_IGNORED[key]))
        else:
            known = {*_ACT_CKPT_MAPPED, *_ACT_CKPT_IGNORED}
            rep.unsupported.append((path, _unknown(key, known, "activation_checkpointing.")))
    out["activation_checkpointing"] = mapped


_ELASTIC_MAPPED = {
    "enabled": "enabled",
    "max_train_batch_size": "max_train_batch_size",
    "micro_batch_sizes": "micro_batch_sizes",
    "min_gpus": "min_world_size",
    "max_gpus": "max_world_size",
    "prefer_larger_batch": "prefer_larger_batch",
    "ignore_non_elastic_batch_info": "ignore_non_elastic_batch_info",
}
_DS_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _map_elasticity(block: Any, out: dict[str, Any], rep: DeepSpeedReport, source: str) -> bool:
    """DeepSpeed's ``elasticity`` block -> ``elasticity`` (v0.1, and v0.2 without model parallelism); True if on."""
    if block is None:
        return False
    if not isinstance(block, Mapping):
        raise UsageError(f"{source}: elasticity must be a mapping, got {type(block).__name__}")
    if not block.get("enabled", False):
        rep.ignored.append(("elasticity", "elasticity.enabled is false"))
        return False
    try:
        version = float(block.get("version", 0.2))  # DeepSpeed's default: its latest, 0.2
    except (TypeError, ValueError):
        raise UsageError(f"{source}: elasticity.version must be 0.1 or 0.2, got {block['version']!r}") from None
    mapped: dict[str, Any] = {}
    for key, value in block.items():
        path = f"elasticity.{key}"
        if key in _ELASTIC_MAPPED:
            mapped[_ELASTIC_MAPPED[key]] = value
            rep.mapped.append((path, f"elasticity.{_ELASTIC_MAPPED[key]}"))
        elif key == "version":
            if version in (0.1, 0.2):
                rep.mapped.append((path, f"the v{version} choice of global batch"))
            else:
                rep.unsupported.append((path, "elasticity versions 0.1 and 0.2 only"))
        elif key == "num_gpus_per_node":
            if version == 0.2:
                mapped["node_size"] = _whole(value, path, source)
                rep.mapped.append((path, "elasticity.node_size (v0.2: world sizes are whole nodes)"))
            else:
                rep.ignored.append((path, "used by elasticity version 0.2 only"))
        elif key == "model_parallel_size":
            _classify(rep, path, _only(1, "model parallelism is not provided")(value), "harmless value")
        elif key == "min_time":
            rep.ignored.append((path, "a hint for the resource scheduler"))
        else:
            known = {*_ELASTIC_MAPPED, "version", "num_gpus_per_node", "model_parallel_size", "min_time"}
            rep.unsupported.append((path, _unknown(key, known, "elasticity.")))
    out["elasticity"] = mapped
    return True


def _drop_non_elastic_batch_keys(ds: Mapping[str, Any], rep: DeepSpeedReport, source: str) -> None:
    """DeepSpeed's rule: with elasticity on, the top-level batch sizes are an error unless explicitly ignored."""
    stated = [k for k in _DS_BATCH_KEYS if k in ds]
    if stated and not ds["elasticity"].get("ignore_non_elastic_batch_info", False):
        raise UsageError(
            f"{source}: {', '.join(stated)} cannot be set with elasticity.enabled (the elasticity block decides the "
            "batch sizes): remove it, or set elasticity.ignore_non_elastic_batch_info: true"
        )
    rep.ignored += [(k, "elasticity decides the batch sizes (ignore_non_elastic_batch_info)") for k in stated]


def _map_zero(zero: Any, out: dict[str, Any], rep: DeepSpeedReport, source: str, dtype: str) -> None:
    if zero is None:
        return
    if not isinstance(zero, Mapping):
        raise UsageError(f"{source}: zero_optimization must be a mapping, got {type(zero).__name__}")
    low = 2 if dtype in ("fp16", "bf16") else 4
    reduce_item = low if out["precision"].get("reduce_in_low_precision") else 4
    mapped: dict[str, Any] = {}
    offload: dict[str, Any] = {}
    for key, value in zero.items():
        path = f"zero_optimization.{key}"
        if key == "stage":
            mapped["stage"] = value
            rep.mapped.append((path, "zero.stage"))
        elif key == "reduce_bucket_size":
            mapped["bucket_bytes"] = _whole(value, path, source) * reduce_item
            rep.mapped.append((path, f"zero.bucket_bytes (elements x {reduce_item} bytes)"))
        elif key == "allgather_bucket_size":
            if "reduce_bucket_size" in zero:
                rep.ignored.append((path, "one bucket layout serves reduce-scatter and all-gather: reduce_bucket_size"))
            else:
                mapped["bucket_bytes"] = _whole(value, path, source) * reduce_item
                rep.mapped.append((path, f"zero.bucket_bytes (elements x {reduce_item} bytes)"))
        elif key == "stage3_prefetch_bucket_size":
            mapped["prefetch"] = _whole(value, path, source) > 0
            rep.mapped.append((path, "zero.prefetch (> 0: prefetch the next unit; the size itself is not used)"))
        elif key in _ZERO_IGNORED:
            rep.ignored.append((path, _ZERO_IGNORED[key]))
        elif key in _OFFLOAD_BLOCKS:
            _map_offload_block(_OFFLOAD_BLOCKS[key], value, offload, rep, path, source)
        elif key in _OFFLOAD_LEGACY:
            _map_offload_legacy(_OFFLOAD_LEGACY[key], value, offload, rep, path)
        elif key in _ZERO_CONDITIONAL:
            _classify(rep, path, _ZERO_CONDITIONAL[key](value), "harmless value")
        else:
            known = (
                _ZERO_MAPPED | set(_ZERO_IGNORED) | set(_ZERO_CONDITIONAL) | set(_OFFLOAD_BLOCKS) | set(_OFFLOAD_LEGACY)
            )
            rep.unsupported.append((path, _unknown(key, known, "zero_optimization.")))
    if offload:
        mapped["offload"] = offload
    out["zero"] = mapped


def _map_offload_block(
    field_name: str, block: Any, offload: dict[str, Any], rep: DeepSpeedReport, path: str, source: str
) -> None:
    """``offload_optimizer`` / ``offload_param``: device cpu turns ``zero.offload.<field_name>`` on (its
    ``pin_memory``, DeepSpeed's default false, and the optimizer's ``ratio`` mapped); none is off; nvme refused."""
    if not isinstance(block, Mapping):
        raise UsageError(f'{source}: {path} must be a mapping like {{"device": "cpu"}}, got {block!r}')
    device = str(block.get("device") or "none").lower()
    if device == "none":
        rep.ignored.append((path, "offload off (device: none)"))
        return
    if device != "cpu":
        reason = _NVME_REFUSED if device == "nvme" else f"device {device!r}: elasticzero offloads to cpu (or none)"
        rep.unsupported.append((f"{path}.device", reason))
        return
    offload[field_name] = True
    offload["pin_memory"] = bool(offload.get("pin_memory")) or bool(block.get("pin_memory", False))
    rep.mapped.append((f"{path}.device", f"zero.offload.{field_name}=true"))
    for key, value in block.items():
        _map_offload_key(field_name, key, value, offload, rep, f"{path}.{key}")


def _map_offload_key(
    field_name: str, key: str, value: Any, offload: dict[str, Any], rep: DeepSpeedReport, path: str
) -> None:
    """One key of an offload block with device cpu."""
    if key == "device":
        return
    if key == "pin_memory":
        rep.mapped.append(
            (path, "zero.offload.pin_memory (one setting for every host buffer: on if any block says so)")
        )
    elif key == "ratio" and field_name == "optimizer":
        offload["ratio"] = float(value)
        rep.mapped.append((path, "zero.offload.ratio (share of the optimizer state's bytes, largest buckets first)"))
    elif key in _OFFLOAD_IGNORED:
        rep.ignored.append((path, _OFFLOAD_IGNORED[key]))
    else:
        known = {"device", "pin_memory", "ratio", *_OFFLOAD_IGNORED}
        rep.unsupported.append((path, _unknown(key, known, path.rsplit(".", 1)[0] + ".")))


def _map_offload_legacy(field_name: str, value: Any, offload: dict[str, Any], rep: DeepSpeedReport, path: str) -> None:
    """DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_params`` / ``cpu_offload_use_pin_memory`` booleans."""
    if not value:
        rep.ignored.append((path, "false: nothing to offload"))
        return
    offload[field_name] = True
    rep.mapped.append((path, f"zero.offload.{field_name}=true (DeepSpeed's deprecated spelling)"))


def _map_optimizer(opt: Any, out: dict[str, Any], rep: DeepSpeedReport, source: str) -> None:
    if opt is None:
        return
    if not isinstance(opt, Mapping):
        raise UsageError(f"{source}: optimizer must be a mapping, got {type(opt).__name__}")
    for key in opt:
        if key == "legacy_fusion":
            rep.ignored.append(("optimizer.legacy_fusion", "DeepSpeed-internal fused kernel switch"))
        elif key not in ("type", "params"):
            rep.unsupported.append((f"optimizer.{key}", _unknown(key, {"type", "params"}, "optimizer.")))
    params = dict(opt.get("params") or {})
    ds_type = str(opt.get("type", "AdamW"))
    name = _OPTIMIZERS.get(ds_type.lower())
    if name is None:
        try:
            import torch.optim

            cls = getattr(torch.optim, ds_type, None)
        except ImportError:  # pragma: no cover
            cls = None
        if not isinstance(cls, type):
            raise UsageError(
                f"{source}: optimizer.type {ds_type!r} has no torch.optim equivalent; use Adam, AdamW, SGD, Adagrad "
                "or a torch.optim class name"
            )
        name = ds_type
    adam_w_mode = params.pop("adam_w_mode", True)
    if ds_type.lower() == "adam":
        name = "AdamW" if adam_w_mode else "Adam"
        rep.mapped.append(("optimizer.params.adam_w_mode", f"optimizer.type={name}"))
    for key, reason in _OPTIMIZER_PARAMS_IGNORED.items():
        if key in params:
            params.pop(key)
            rep.ignored.append((f"optimizer.params.{key}", reason))
    if "bias_correction" in params:
        if params.pop("bias_correction") is False:
            rep.unsupported.append(("optimizer.params.bias_correction", "torch's Adam always corrects the bias"))
        else:
            rep.ignored.append(("optimizer.params.bias_correction", "torch's Adam always corrects the bias"))
    if "max_grad_norm" in params:
        params.pop("max_grad_norm")
        rep.unsupported.append(("optimizer.params.max_grad_norm", "use gradient_clipping"))
    if "betas" in params:
        params["betas"] = list(params["betas"])
    out["optimizer"] = {"type": name, "params": params}
    rep.mapped.append(("optimizer.type", f"optimizer.type={name}"))
    if params:
        rep.mapped.append(("optimizer.params", "optimizer.params"))


# ------------------------------------------------------------------------------------------------ the key table
def key_verdicts() -> dict[str, str]:
    """Every DeepSpeed key this module knows, by dotted path, with what loading does to it whatever its value:
    ``"mapped"``, ``"ignored"``, ``"refused"`` (reported unsupported), or ``"depends"`` (the value decides: for most,
    ignored at the harmless value and refused at any other). Keys whose section is judged whole (``flops_profiler``,
    ``autotuning``, ...) are listed by the section. The migration table in docs/engine.md lists exactly these keys
    with these verdicts (a unit test reads it), so the guide and the loader cannot drift apart."""
    table = {
        **dict.fromkeys(_MAPPED_TOP, "mapped"),
        **dict.fromkeys(_IGNORED_TOP, "ignored"),
        **dict.fromkeys(_UNSUPPORTED_TOP, "refused"),
        **{k: _verdict(check) for k, check in _CONDITIONAL_TOP.items()},
    }
    sections: list[tuple[str, Any, Any, Any]] = [  # (section, mapped, ignored, conditional)
        ("zero_optimization", _ZERO_MAPPED, _ZERO_IGNORED, _ZERO_CONDITIONAL),
        ("fp16", _FP16_MAPPED, {}, _FP16_CONDITIONAL),
        ("bf16", {"enabled"}, {}, _BF16_CONDITIONAL),
        ("optimizer", {"type", "params", "params.adam_w_mode"}, {"legacy_fusion", *_OPTIMIZER_PARAMS_IGNORED}, {}),
        ("activation_checkpointing", _ACT_CKPT_MAPPED, _ACT_CKPT_IGNORED, {}),
        ("elasticity", {*_ELASTIC_MAPPED, "version", "num_gpus_per_node"}, {"min_time"}, {}),
    ]
    for section, mapped, ignored, conditional in sections:
        table |= {f"{section}.{k}": "mapped" for k in mapped}
        table |= {f"{section}.{k}": "ignored" for k in ignored}
        table |= {f"{section}.{k}": _verdict(check) for k, check in conditional.items()}
    table |= {f"optimizer.params.{k}": "ignored" for k in _OPTIMIZER_PARAMS_IGNORED}
    del table["optimizer.torch_adam"], table["optimizer.fused"]  # params keys, added just above
    table |= {"scheduler.type": "mapped", "scheduler.params": "mapped"}
    for block in _OFFLOAD_BLOCKS:  # none: ignored; cpu: mapped; nvme: refused
        path = f"zero_optimization.{block}"
        table |= {path: "depends", f"{path}.device": "depends", f"{path}.pin_memory": "mapped"}
        table |= {f"{path}.{k}": "ignored" for k in _OFFLOAD_IGNORED}
    table["zero_optimization.offload_optimizer.ratio"] = "mapped"
    table |= {f"zero_optimization.{k}": "depends" for k in _OFFLOAD_LEGACY}  # false: ignored; true: mapped
    table |= {
        "optimizer.params.bias_correction": "depends",
        "optimizer.params.max_grad_norm": "refused",
        "elasticity.model_parallel_size": "depends",
    }
    return table


_ANY = object()  # a value no check calls harmless


def _verdict(check: _Check) -> str:
    """``"ignored"`` for a check that accepts any value, else ``"depends"``."""
    try:
        return "ignored" if check(_ANY) is None else "depends"
    except TypeError:  # a check comparing numbers
        return "depends"


def _map_scheduler(sched: Any, out: dict[str, Any], rep: DeepSpeedReport, source: str) -> None:
    """``scheduler: {type, params}`` -> ``scheduler`` (the same names: the schedules take DeepSpeed's parameters;
    the type and every parameter are checked with the rest of the config)."""
    if sched is None:
        return
    if not isinstance(sched, Mapping):
        raise UsageError(
            f'{source}: scheduler must be a mapping like {{"type": "WarmupLR", "params": {{}}}}, got {sched!r}'
        )
    for key in sched:
        if key not in ("type", "params"):
            rep.unsupported.append((f"scheduler.{key}", _unknown(key, {"type", "params"}, "scheduler.")))
    if sched.get("type") is None:  # DeepSpeed builds no schedule without a type
        rep.ignored.append(("scheduler", "no scheduler.type: DeepSpeed builds no schedule"))
        return
    params = sched.get("params") or {}
    if not isinstance(params, Mapping):
        raise UsageError(f"{source}: scheduler.params must be a mapping of the schedule's parameters, got {params!r}")
    out["scheduler"] = {"type": sched["type"], "params": dict(params)}
    rep.mapped.append(("scheduler.type", "scheduler.type"))
    if params:
        rep.mapped.append(("scheduler.params", "scheduler.params"))


# ------------------------------------------------------------------------------------------------ helpers
_AUTO_UNFILLED = '"auto" needs a value: write it, or fill it with elasticzero.config.fill_auto(config, AutoValues(...))'


def _drop_auto(d: Mapping[str, Any], prefix: str, rep: DeepSpeedReport) -> dict[str, Any]:
    """Copy of ``d`` without ``"auto"`` values (each reported unsupported)."""
    kept: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, str) and value.strip().lower() == "auto":
            rep.unsupported.append((path, _AUTO_UNFILLED))
        elif isinstance(value, Mapping):
            kept[key] = _drop_auto(value, f"{path}.", rep)
        else:
            kept[key] = value
    return kept


def _classify(rep: DeepSpeedReport, path: str, reason: str | None, harmless: str) -> None:
    if reason is None:
        rep.ignored.append((path, harmless))
    else:
        rep.unsupported.append((path, reason))


def _unknown(key: str, known: set[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return f"not a DeepSpeed key elasticzero knows{hint}"


def _block(ds: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    block = ds.get(key) or {}
    if not isinstance(block, Mapping):
        raise UsageError(f'{source}: {key} must be a mapping like {{"enabled": true}}, got {block!r}')
    return block


def _whole(value: Any, path: str, source: str) -> int:
    """An integer from JSON's 5e8-style numbers; error for fractions, strings, booleans and null."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value % 1:
        raise UsageError(f"{source}: {path} must be a whole number, got {value!r}")
    return int(value)


def _maybe_whole(value: Any, path: str, source: str) -> int | None:
    return None if value is None else _whole(value, path, source)
