"""Elastic batch planning: the global batch stays constant when the world size changes; the plan adapts.

``global = micro * accumulation * world``. Across a restart at another world size the global batch ``G`` (and so the
training result, up to reduction order) stays the same; the micro batch and the accumulation steps are re-chosen:

* ``elasticity.enabled`` (DeepSpeed's ``elasticity`` block): ``G`` is chosen up front from ``max_train_batch_size``
  and ``micro_batch_sizes`` the way DeepSpeed's elasticity v0.1/v0.2 does (the candidate with the most valid world
  sizes in ``[min_world_size, max_world_size]``); at world ``W`` the largest allowed micro batch ``m`` with
  ``G % (m * W) == 0`` is used.
* ``train_batch_size`` set and ``accumulation_steps`` not: ``G`` and the micro batch are fixed, the accumulation is
  derived per world (world ``W`` is valid when ``G % (micro * W) == 0``).

Everything here is pure: :class:`ElasticBatch` answers "which plan at world W", "which world sizes are valid" and
:func:`check_world_range` lets a launcher fail at start when ``--nnodes MIN:MAX`` allows a world with no plan.
"""

from __future__ import annotations

import math
from collections.abc import Set
from dataclasses import dataclass

from elasticzero.config.batch import check_batch_sizes, resolve_batch_sizes
from elasticzero.config.schema import ElasticityConfig, EngineConfig
from elasticzero.errors import UsageError

__all__ = [
    "BatchPlan",
    "ElasticBatch",
    "apply_batch_plan",
    "batch_plan",
    "check_elasticity",
    "check_world_range",
    "deepspeed_global_batch",
    "elastic_batch",
]

BATCH_KEYS = ("train_batch_size", "micro_batch_size", "accumulation_steps")

# Highly composite numbers (OEIS A002182) up to 720720: DeepSpeed scales each base batch by the largest of these that
# keeps it under max_train_batch_size, so the global batch has many divisors (many valid world sizes).
_HCN = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
        20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
        665280, 720720)  # fmt: skip


@dataclass(frozen=True)
class BatchPlan:
    """The batch sizes at one world size."""

    global_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    world_size: int


@dataclass(frozen=True)
class ElasticBatch:
    """A constant global batch and the micro batch sizes allowed to split it (largest preferred)."""

    global_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_world_size: int = 1
    max_world_size: int | None = None  # None: up to the global batch
    node_size: int = 1  # world sizes must be whole nodes of this many ranks (DeepSpeed elasticity v0.2)
    source: str = "<config>"

    def plan(self, world_size: int) -> BatchPlan | None:
        """The plan at ``world_size``, or None when that world size cannot split the global batch."""
        if not self._in_range(world_size):
            return None
        for micro in sorted(set(self.micro_batch_sizes), reverse=True):
            if self.global_batch_size % (micro * world_size) == 0:
                accum = self.global_batch_size // (micro * world_size)
                return BatchPlan(self.global_batch_size, micro, accum, world_size)
        return None

    def require(self, world_size: int) -> BatchPlan:
        """The plan at ``world_size``, or a :class:`UsageError` naming the valid world sizes."""
        plan = self.plan(world_size)
        if plan is None:
            raise UsageError(f"{self.source}: {self._why(world_size)}")
        return plan

    def valid_world_sizes(self) -> list[int]:
        """Every world size with a plan, ascending."""
        hi = self.max_world_size or self.global_batch_size
        return [w for w in range(self.min_world_size, min(hi, self.global_batch_size) + 1) if self.plan(w)]

    def _in_range(self, world: int) -> bool:
        hi = self.max_world_size or self.global_batch_size
        return self.min_world_size <= world <= hi and world % self.node_size == 0

    def _why(self, world: int) -> str:
        micros = "/".join(map(str, sorted(set(self.micro_batch_sizes))))
        return (
            f"world size {world} has no batch plan: global batch {self.global_batch_size} is not micro batch "
            f"{micros} x accumulation x {world} ranks (valid world sizes: {_ranges(self.valid_world_sizes())})"
        )


def check_world_range(batch: ElasticBatch, min_nodes: int, max_nodes: int, nproc_per_node: int) -> None:
    """Fail at start when ``--nnodes MIN:MAX`` x ``--nproc-per-node`` allows a world size with no batch plan."""
    bad = [n * nproc_per_node for n in range(min_nodes, max_nodes + 1) if batch.plan(n * nproc_per_node) is None]
    if bad:
        nnodes = f"{min_nodes}:{max_nodes}" if min_nodes != max_nodes else str(min_nodes)
        raise UsageError(
            f"{batch.source}: --nnodes {nnodes} x --nproc-per-node {nproc_per_node} allows world "
            f"size(s) {_ranges(bad)} with no batch plan for global batch {batch.global_batch_size} (valid world "
            f"sizes: {_ranges(batch.valid_world_sizes())}); narrow --nnodes or change the batch sizes"
        )


def elastic_batch(cfg: EngineConfig, source: str = "<config>") -> ElasticBatch | None:
    """The constant global batch ``cfg`` asks for (elasticity block, else ``train_batch_size`` with its micro batch),
    or None when the global batch follows the world size (only micro batch and accumulation are set)."""
    e = cfg.elasticity
    if e.enabled:
        check_elasticity(e, source)
        micros = tuple(e.micro_batch_sizes)
        assert e.max_train_batch_size is not None
        g = deepspeed_global_batch(
            e.max_train_batch_size, micros, e.min_world_size, e.max_world_size, e.prefer_larger_batch, e.node_size
        )
        if g is None:
            raise UsageError(
                f"{source}: elasticity: no global batch <= max_train_batch_size={e.max_train_batch_size} splits into "
                f"micro batches {list(micros)} at any world size in [{e.min_world_size}, {e.max_world_size or 'any'}]"
                " (raise max_train_batch_size or add micro_batch_sizes)"
            )
        return ElasticBatch(g, micros, e.min_world_size, e.max_world_size, e.node_size, source)
    if cfg.train_batch_size is not None:
        return ElasticBatch(cfg.train_batch_size, (cfg.micro_batch_size,), source=source)
    return None


def check_elasticity(e: ElasticityConfig, source: str = "<config>") -> None:
    """Ranges of an enabled elasticity block; one :class:`UsageError` line naming the key."""

    def need(ok: bool, key: str, rule: str, value: object) -> None:
        if not ok:
            raise UsageError(f"{source}: elasticity.{key} {rule}, got {value!r}")

    need(e.max_train_batch_size is not None and e.max_train_batch_size >= 1, "max_train_batch_size", "must be >= 1 "
         "when elasticity is enabled", e.max_train_batch_size)  # fmt: skip
    micros = e.micro_batch_sizes
    need(bool(micros) and all(m >= 1 for m in micros), "micro_batch_sizes", "must be a non-empty list of sizes >= 1",
         micros)  # fmt: skip
    assert e.max_train_batch_size is not None
    need(max(micros) <= e.max_train_batch_size, "micro_batch_sizes", "must all be <= max_train_batch_size", micros)
    need(e.min_world_size >= 1, "min_world_size", "must be >= 1", e.min_world_size)
    need(e.max_world_size is None or e.max_world_size >= e.min_world_size, "max_world_size",
         f"must be >= min_world_size={e.min_world_size}", e.max_world_size)  # fmt: skip
    need(e.node_size >= 1, "node_size", "must be >= 1", e.node_size)


def apply_batch_plan(cfg: EngineConfig, given: Set[str], world: int | None, source: str = "<config>") -> None:
    """Fill ``cfg``'s batch sizes for ``world`` when the global batch is constant (see the module doc).

    ``given``: the batch keys the user stated. With elasticity on, stating any is an error (DeepSpeed's rule) unless
    ``ignore_non_elastic_batch_info``. Otherwise, with ``train_batch_size`` stated and ``accumulation_steps`` not,
    the accumulation (and without a stated micro batch, the micro batch) is derived at ``world``.
    """
    if cfg.elasticity.enabled:
        stated = [k for k in BATCH_KEYS if k in given]
        if stated and not cfg.elasticity.ignore_non_elastic_batch_info:
            raise UsageError(
                f"{source}: {', '.join(stated)} cannot be set with elasticity.enabled (the elasticity block decides "
                "the batch sizes): remove it, or set elasticity.ignore_non_elastic_batch_info: true"
            )
        batch = elastic_batch(cfg, source)
        assert batch is not None
        plan = batch.require(world) if world is not None else _any_plan(batch)
    elif cfg.train_batch_size is not None and "accumulation_steps" not in given and world is not None:
        if "micro_batch_size" in given:
            plan = ElasticBatch(cfg.train_batch_size, (cfg.micro_batch_size,), source=source).require(world)
        else:
            _, micro, accum = resolve_batch_sizes(cfg.train_batch_size, None, None, world, source)
            plan = BatchPlan(cfg.train_batch_size, micro, accum, world)
    else:
        return
    cfg.train_batch_size, cfg.micro_batch_size = plan.global_batch_size, plan.micro_batch_size
    cfg.accumulation_steps = plan.accumulation_steps


def batch_plan(cfg: EngineConfig, world: int, source: str = "config") -> BatchPlan:
    """The batch sizes ``cfg`` trains with at ``world`` ranks (what :func:`~elasticzero.config.build_pieces` and
    :func:`~elasticzero.data.build_loader` build from): with ``elasticity`` on, the block's plan for this world
    (whatever world the config was loaded for); otherwise the config's own sizes, checked against ``world``."""
    if cfg.elasticity.enabled:
        batch = elastic_batch(cfg, source)
        assert batch is not None
        return batch.require(world)
    check_batch_sizes(cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps, world, source)
    micro, accum = cfg.micro_batch_size, cfg.accumulation_steps
    return BatchPlan(micro * accum * world, micro, accum, world)


def _any_plan(batch: ElasticBatch) -> BatchPlan:
    """World size unknown (no job running): the largest micro batch dividing the global batch, accumulation 1."""
    micro = max((m for m in batch.micro_batch_sizes if batch.global_batch_size % m == 0), default=1)
    return BatchPlan(batch.global_batch_size, micro, 1, 0)


def deepspeed_global_batch(
    max_batch: int,
    micro_batch_sizes: tuple[int, ...],
    min_world: int = 1,
    max_world: int | None = None,
    prefer_larger: bool = True,
    node_size: int = 1,
) -> int | None:
    """DeepSpeed elasticity's choice of global batch (v0.1; v0.2 when ``node_size > 1``), None if none is valid.

    Candidates: each micro batch size and their LCM, scaled by the largest highly composite number keeping it
    ``<= max_batch``; the winner has the most valid world sizes in range, ties broken towards the larger
    (``prefer_larger``) or smaller batch. v0.2 runs this per node and scales the result by ``node_size``.
    """
    if node_size > 1:
        per_node = deepspeed_global_batch(
            max_batch // node_size,
            micro_batch_sizes,
            max(1, min_world // node_size),
            None if max_world is None else max_world // node_size,
            prefer_larger,
        )
        return None if per_node is None else per_node * node_size
    max_world = max_world or max_batch // min(micro_batch_sizes)
    bases = [*micro_batch_sizes, math.lcm(*micro_batch_sizes)]
    best, best_count = None, 0
    for size in sorted({_scaled(b, max_batch) for b in bases if b <= max_batch}):
        count = len(ElasticBatch(size, micro_batch_sizes, min_world, max_world).valid_world_sizes())
        if count > best_count or (count == best_count and count and prefer_larger):
            best, best_count = size, count
    return best


def _scaled(base: int, max_batch: int) -> int:
    return base * max(h for h in _HCN if base * h <= max_batch) if base < max_batch else base


def _ranges(values: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``; ``"none"`` when empty."""
    out: list[str] = []
    for v in values:
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out) or "none"
