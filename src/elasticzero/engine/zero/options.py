"""The options of a ZeRO stage (:class:`ZeroOptions`): everything a stage is built with besides the model, the
wrapped optimizer's class and its keyword arguments, as one frozen value shared by the three stages.

A stage constructor takes them as keyword arguments (``ZeroStage2(model, torch.optim.AdamW, lr=1e-3,
bucket_bytes=...)``) or whole (``options=ZeroOptions(...)``); :meth:`ZeroOptions.split` is the one place that tells
the two kinds of keyword arguments apart. A field that not every stage takes names its stages in its metadata
(:func:`stages_only`); :meth:`ZeroOptions.taken_by` reads them (config/build.py asks it which ``zero.*`` keys a stage
ignores). Adding an option is adding a field here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from elasticzero.engine.bucketer import DEFAULT_BUCKET_BYTES
from elasticzero.engine.precision import PrecisionPolicy
from elasticzero.engine.zero.offload import OffloadOptions
from elasticzero.errors import UsageError

UnitSpec = Iterable[nn.Module] | tuple[type[nn.Module], ...] | type[nn.Module] | Callable[[nn.Module], bool] | None
"""Which submodules ZeRO-3 gathers and frees as one unit (see :class:`~elasticzero.engine.zero.stage3.ZeroStage3`)."""


def stages_only(*stages: int) -> dict[str, frozenset[int]]:
    """The metadata of a field taken by ``stages`` only (a field without it: every stage takes it)."""
    return {"stages": frozenset(stages)}


@dataclass(frozen=True)
class ZeroOptions:
    """How a ZeRO stage is built (every stage, unless a field says otherwise).

    Args:
        process_group: data-parallel group (default: the default group); exposed as ``opt.process_group``.
        precision: ``"fp32" | "bf16" | "fp16"`` or a :class:`~elasticzero.engine.precision.PrecisionPolicy`.
        bucket_bytes: bucket bound in bytes of ``reduce_dtype`` (ZeRO-3 ignores it: one bucket per unit).
        max_inflight: outstanding gradient collectives during backward (bounds transient buffers).
        timers: optional ``PhaseTimers`` (phases ``"reduce"``, ``"step"``, ``"allgather"``); None costs nothing.
        sync_module_states: broadcast parameters and buffers from group rank 0 at construction.
        cast_forward_inputs: under a low-precision policy, cast floating-point forward inputs of the module to the
            compute dtype.
        units, reshard_after_forward, prefetch, prefetch_bytes: stage 3 only (see
            :class:`~elasticzero.engine.zero.stage3.ZeroStage3`).
        offload: ZeRO-Offload (:class:`~elasticzero.engine.zero.offload.OffloadOptions`): the fp32 masters, the
            optimizer state and the step in host memory, for the buckets its budget picks (its ``params``: stage 3
            only); on a CPU device it changes nothing. None: everything on the device (docs/engine.md,
            "ZeRO-Offload").
    """

    process_group: Any = None
    precision: str | PrecisionPolicy = "fp32"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    max_inflight: int = 2
    timers: Any = None
    sync_module_states: bool = True
    cast_forward_inputs: bool = True
    units: UnitSpec = field(default=None, metadata=stages_only(3))
    reshard_after_forward: bool = field(default=True, metadata=stages_only(3))
    prefetch: bool = field(default=True, metadata=stages_only(3))
    prefetch_bytes: int = field(default=0, metadata=stages_only(3))
    offload: OffloadOptions | None = None

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every option's name."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def taken_by(cls, stage: int) -> frozenset[str]:
        """The options stage ``stage`` takes."""
        return frozenset(f.name for f in fields(cls) if stage in f.metadata.get("stages", (stage,)))

    @classmethod
    def split(
        cls, kwargs: Mapping[str, Any], stage: int, base: ZeroOptions | None = None
    ) -> tuple[ZeroOptions, dict[str, Any]]:
        """A stage constructor's keyword arguments as (``base`` with the options among them, the rest: the wrapped
        optimizer's); a :class:`UsageError` for an option stage ``stage`` does not take."""
        chosen = {k: v for k, v in kwargs.items() if k in cls.names()}
        refused = sorted(chosen.keys() - cls.taken_by(stage))
        if refused:
            raise UsageError(f"ZeroStage{stage} does not take {', '.join(refused)} (an option of other ZeRO stages)")
        rest = {k: v for k, v in kwargs.items() if k not in chosen}
        return dataclasses.replace(base if base is not None else cls(), **chosen), rest
