"""The engine's configuration schema: omegaconf structured dataclasses, one per concern.

A YAML/JSON/hjson file mirrors the dataclasses (see ``docs/engine.md``)::

    zero: {stage: 2, bucket_bytes: 104857600}
    precision: {dtype: bf16}
    optimizer: {type: AdamW, params: {lr: 3.0e-4, weight_decay: 0.1}}
    scheduler: {type: WarmupDecayLR, params: {warmup_max_lr: 3.0e-4, warmup_num_steps: 100, total_num_steps: 5000}}
    clip_grad_norm: 1.0
    accumulation_steps: 4
    micro_batch_size: 8

Everything has a default; ``None`` means "the piece's own default" (ZeRO options) or "automatic" (loss scaling is on
exactly when ``precision.dtype`` is fp16). Types are checked by omegaconf; ranges and cross-field rules by
:func:`elasticzero.config.load.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "ActivationCheckpointingConfig",
    "ElasticityConfig",
    "EngineConfig",
    "LossScaleConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "Precision",
    "PrecisionConfig",
    "SchedulerConfig",
    "TimersConfig",
    "ZeroConfig",
]


class Precision(Enum):
    """Compute dtype of the model copies (masters and optimizer state stay fp32)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class CopiesConfig:
    """Live recovery's buddy copies (:class:`~elasticzero.live.copies.BuddyCopies`), used under
    ``elasticzero-run --live-recovery``: every rank's ZeRO state copied to a rank of another node (``zero.copies``;
    ``zero.replicas``, its old name, is still read)."""

    enabled: bool = True  # off: a lost node's shards come from the disk checkpoint (one node: always off)
    node_shift: int = 1  # copies go this many nodes further along the ring of nodes
    overlap: bool = True  # step the copies on a background thread, overlapping the next forward/backward
    early: bool = True  # send each bucket's gradient to its holder during backward (False: all at the step)


@dataclass
class OffloadConfig:
    """ZeRO-Offload (:mod:`elasticzero.engine.zero.offload`; DeepSpeed's ``offload_optimizer`` / ``offload_param``):
    what lives in host memory instead of the device's. On a CPU device it changes nothing (the state is there)."""

    optimizer: bool = False  # fp32 masters, optimizer state and the optimizer step in host memory (stages 1-3)
    params: bool = False  # stage 3 only: the parameter shards too, each unit gathered from there (needs optimizer)
    pin_memory: bool = True  # page-locked host buffers for what crosses the bus (pageable: every copy synchronous)
    ratio: float = 1.0  # share of the optimizer state's bytes offloaded, the largest buckets first
    device_budget_bytes: int | None = None  # instead of ratio: bytes of masters + optimizer state kept on the device
    step_in_backward: bool = True  # step each offloaded bucket as its gradient lands, when nothing forbids it


@dataclass
class ZeroConfig:
    """Which ZeRO stage shards what, and how communication is bucketed (``None``: the stage's default)."""

    stage: int = 0  # 0 = no sharding (plain optimizer; use DDP), 1 = optimizer state, 2 = + gradients, 3 = + params
    # one flat-bucket layout serves the gradient reduce(-scatter) and the parameter all-gather: bytes of the
    # reduction dtype per bucket
    bucket_bytes: int | None = None
    prefetch: bool | None = None  # stage 3: all-gather the next unit while the current one computes
    reshard_after_forward: bool | None = None  # stage 3: free each unit after its forward (3Ψ) or keep it (2Ψ)
    copies: CopiesConfig = field(default_factory=CopiesConfig)  # live recovery's in-memory buddy copies
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # ZeRO-Offload: state in host memory


@dataclass
class LossScaleConfig:
    """:class:`elasticzero.LossScaler` settings (DeepSpeed's ``fp16`` block)."""

    enabled: bool | None = None  # None: on iff precision.dtype is fp16
    dynamic: bool = True
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0


@dataclass
class PrecisionConfig:
    """Compute dtype, reduction dtype and loss scaling."""

    dtype: Precision = Precision.fp32
    reduce_in_low_precision: bool = False  # reduce gradients in ``dtype`` instead of fp32 (half the traffic)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)


@dataclass
class OptimizerConfig:
    """A ``torch.optim`` class by name (``AdamW``, ``Adam``, ``SGD``, ...) and its constructor keyword arguments."""

    type: str = "AdamW"
    params: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3})


@dataclass
class SchedulerConfig:
    """A learning-rate schedule on the optimizer: DeepSpeed's ``scheduler`` block, the same names and ``params``
    (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``; see
    :mod:`elasticzero.engine.lr_schedules`). ``type: null``: none, the optimizer's ``lr`` throughout."""

    type: str | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class TimersConfig:
    """:class:`elasticzero.PhaseTimers` settings."""

    enabled: bool = False
    synchronize: bool = False  # torch.cuda.synchronize() around phases (only when CUDA is available)


@dataclass
class ElasticityConfig:
    """A global batch that stays constant across world sizes (DeepSpeed's ``elasticity`` block; see
    :mod:`elasticzero.config.elastic`). When enabled, the batch sizes come from here, not from the top-level keys."""

    enabled: bool = False
    max_train_batch_size: int | None = None  # the global batch chosen is at most this
    micro_batch_sizes: list[int] = field(default_factory=list)  # allowed micro batches per rank, largest preferred
    min_world_size: int = 1  # DeepSpeed: min_gpus
    max_world_size: int | None = None  # DeepSpeed: max_gpus; None = no limit
    node_size: int = 1  # world sizes are whole nodes of this many ranks (DeepSpeed v0.2: num_gpus_per_node)
    prefer_larger_batch: bool = True  # between equally elastic candidates, take the larger global batch
    ignore_non_elastic_batch_info: bool = False  # drop top-level batch sizes instead of refusing them


@dataclass
class ActivationCheckpointingConfig:
    """Activation checkpointing of the model's repeated blocks
    (:func:`~elasticzero.engine.activations.checkpoint_activations`; DeepSpeed's ``activation_checkpointing``)."""

    enabled: bool = False
    cpu: bool = False  # keep the checkpointed blocks' inputs in host memory until the backward (cpu_checkpointing)
    blocks: str | None = None  # class name of the blocks; None = those of the model's largest ModuleList of one class


@dataclass
class EngineConfig:
    """Every engine setting; the root of a native config file."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    timers: TimersConfig = field(default_factory=TimersConfig)
    clip_grad_norm: float = 0.0  # max global gradient norm; 0 = no clipping
    accumulation_steps: int = 1  # micro-batches per optimizer step
    micro_batch_size: int = 1  # samples per rank per micro-batch
    train_batch_size: int | None = None  # global batch; if set, must equal micro * accumulation * world
    elasticity: ElasticityConfig = field(default_factory=ElasticityConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
