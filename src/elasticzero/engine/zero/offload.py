"""ZeRO-Offload, the decisions: which buckets keep their fp32 masters and optimizer state in host memory, whether the
bytes that cross the bus are page-locked and copied on a side stream, and whether a bucket may take its optimizer
step during backward. Pure functions over plain values; the copies themselves are :mod:`~elasticzero.engine.zero.host`.

What goes where (a bucket whose home is the host, on a CUDA device)::

    device: the compute copy of the parameters (stages 1/2: the whole bucket; stage 3: gathered units, and without
            ``params`` a compute-dtype copy of this rank's shard), the gradient bucket while it is reduced
    host:   the fp32 master shard, the optimizer state, the fp32 gradient shard; the step runs there (fused CPU AdamW)
    bus:    gradient shard D2H as soon as its reduction completes (side stream, after the reduction's event), updated
            parameter shard H2D after its step (side stream; the next use waits on its event)

On a CPU device the state is already in host memory: offload is the identity (no bucket changes home) unless
``cpu_copies`` asks for the host path anyway (separate host buffers, synchronous copies, the per-bucket step):
what a GPU run does, checkable without one.

The device is read from :func:`elasticzero.device.placement`'s rule (``"cpu"`` or ``"cuda:N"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elasticzero.errors import UsageError

__all__ = [
    "BucketHome",
    "OffloadOptions",
    "OffloadPlan",
    "budget_for",
    "early_step_blocker",
    "plan_homes",
    "plan_offload",
]


@dataclass(frozen=True)
class OffloadOptions:
    """What was asked (config ``zero.offload``; DeepSpeed ``offload_optimizer`` / ``offload_param``).

    ``optimizer``: fp32 masters, optimizer state and the step in host memory (stages 1-3). ``params``: stage 3, the
    parameter shards live in host memory too and each unit is gathered from there (needs ``optimizer``: in stage 3
    the sharded parameters *are* the fp32 masters the optimizer steps). ``pin_memory``: page-locked host buffers for
    what crosses the bus (pageable memory makes every copy synchronous). ``ratio``: the share of the optimizer state's
    bytes to offload, largest buckets first (DeepSpeed's ``ratio``); ``device_budget_bytes``, when set, wins over it:
    the bytes of masters + optimizer state allowed to stay on the device. ``step_in_backward``: step each offloaded
    bucket on the host as its gradient lands, during backward, where :func:`early_step_blocker` allows it.
    ``cpu_copies``: on a CPU device take the host path anyway (see the module)."""

    optimizer: bool = False
    params: bool = False
    pin_memory: bool = True
    ratio: float = 1.0
    device_budget_bytes: int | None = None
    step_in_backward: bool = True
    cpu_copies: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise UsageError(f"zero.offload.ratio must be in [0, 1], got {self.ratio!r}")
        if self.device_budget_bytes is not None and self.device_budget_bytes < 0:
            raise UsageError(f"zero.offload.device_budget_bytes must be >= 0, got {self.device_budget_bytes!r}")
        if self.params and not self.optimizer:
            raise UsageError(
                "zero.offload.params needs zero.offload.optimizer: in ZeRO-3 the parameter shards are the fp32 masters "
                "the optimizer steps (DeepSpeed: offload_param with offload_optimizer: {device: cpu})"
            )

    @property
    def enabled(self) -> bool:
        return self.optimizer


def check_stage(options: OffloadOptions | None, stage: int) -> None:
    """:class:`UsageError` for ``params`` below stage 3 (stages 1/2 keep whole parameters on every rank)."""
    if options is not None and options.params and stage != 3:
        raise UsageError(
            f"zero.offload.params (DeepSpeed offload_param) is for ZeRO stage 3 only, this is stage {stage}: stages "
            "1/2 keep the whole parameters on the device; drop it, or use stage 3"
        )


@dataclass(frozen=True)
class BucketHome:
    """Where one bucket's optimizer state lives and how its bytes move.

    ``host``: masters, optimizer state and gradient shard in host memory, stepped there. ``copies``: gradients and
    parameters cross between the device and the host (False: the device is the host, nothing moves). ``pinned``:
    the host buffers that cross are page-locked. ``side_stream``: the copies run on a copy stream fenced by events
    (CUDA). ``params_on_host``: stage 3 gathers the unit from the host shard (no device copy of the shard)."""

    host: bool = False
    copies: bool = False
    pinned: bool = False
    side_stream: bool = False
    params_on_host: bool = False


@dataclass(frozen=True)
class OffloadPlan:
    """Every bucket's :class:`BucketHome` (equal on every rank: bucket shard sizes are)."""

    homes: tuple[BucketHome, ...]

    @property
    def any_host(self) -> bool:
        return any(h.host for h in self.homes)

    @property
    def side_stream(self) -> bool:
        return any(h.side_stream for h in self.homes)

    def offloaded(self) -> list[int]:
        return [i for i, h in enumerate(self.homes) if h.host]


def plan_offload(sizes: Sequence[int], budget: int) -> tuple[bool, ...]:
    """Which buckets to offload (True) so that the bytes left on the device are at most ``budget``: the largest
    first (fewest transfers for the bytes freed), ties by bucket index. ``sizes``: bytes of each bucket's masters +
    optimizer state on this rank."""
    if budget < 0:
        raise UsageError(f"an offload budget must be >= 0 bytes, got {budget}")
    kept = sum(sizes)
    out = [False] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if kept <= budget:
            break
        out[i] = True
        kept -= sizes[i]
    return tuple(out)


def budget_for(options: OffloadOptions, sizes: Sequence[int]) -> int:
    """The bytes of optimizer state allowed on the device: ``device_budget_bytes`` when set, else what ``ratio``
    leaves (``ratio`` 1: nothing, 0: everything)."""
    if options.device_budget_bytes is not None:
        return options.device_budget_bytes
    return int((1.0 - options.ratio) * sum(sizes))


def plan_homes(options: OffloadOptions | None, device: str, sizes: Sequence[int]) -> OffloadPlan:
    """Each bucket's home for ``options`` on ``device`` (``"cpu"`` / ``"cuda:N"``: the vocabulary of
    :func:`elasticzero.device.placement`) with ``sizes`` bytes of optimizer state per bucket. No options, or a CPU
    device without ``cpu_copies``: every bucket stays where it is (on the CPU that is host memory already)."""
    if options is None or not options.enabled:
        return OffloadPlan((BucketHome(),) * len(sizes))
    cuda = device.split(":")[0] == "cuda"
    if not cuda and not options.cpu_copies:
        return OffloadPlan((BucketHome(),) * len(sizes))
    chosen = plan_offload(sizes, budget_for(options, sizes))
    away = BucketHome(
        host=True,
        copies=True,
        pinned=cuda and options.pin_memory,
        side_stream=cuda,
        params_on_host=options.params,
    )
    return OffloadPlan(tuple(away if c else BucketHome() for c in chosen))


def early_step_blocker(*, armed: bool, clipping: bool, loss_scaling: bool, watched: bool) -> str | None:
    """Why the offloaded buckets may not step during this backward (None: they may, each as its gradient lands).

    A bucket's step during backward must be the step ``optimizer_step`` would take after it: so this backward must
    end the optimizer step (``armed``: the accumulation boundary, said by the caller), no global-norm clip may scale
    the gradients first (the norm needs every bucket), no loss scaler may unscale them and decide to skip the step on
    an overflow found anywhere, and nobody may be watching the shards (live recovery's buddy copy replays unscale,
    clip and step at the step's commit gate)."""
    if not armed:
        return "not the backward that ends the optimizer step"
    if clipping:
        return "global-norm clipping needs every bucket's gradient before any step"
    if loss_scaling:
        return "the loss scaler's overflow check must pass on every rank before any step"
    if watched:
        return "the gradient shards are watched (live recovery's copies replay the step at its commit)"
    return None
