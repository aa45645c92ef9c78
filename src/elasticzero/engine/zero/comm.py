"""The one place where every ZeRO / bucketer collective is issued, and where it is counted.

Each function is a thin, pure wrapper around one ``torch.distributed`` call that first records the call in a
:class:`CommStats` (the optimizer's own, when given) and in :data:`GLOBAL_COMM_STATS`. Elements are counted as the
``numel`` of the *full* buffer of the collective: the input of a reduce-scatter, the output of an all-gather, the
tensor of an all-reduce or broadcast. So a ZeRO-2 step over Ψ parameters counts Ψ (+ at most ``world_size - 1``
padding elements per bucket) of ``reduce_scatter`` and as many of ``all_gather``.

Every call carries a ``tag`` saying why it was issued: ``"grad"`` (gradient reduction), ``"param"`` (parameter
all-gather), ``"norm"`` (global gradient norm, one scalar), ``"init"`` (one-time broadcast of the initial state),
``"state_dict"`` (:meth:`full_state_dict`). A benchmark counting traffic per step sums the ``grad`` and ``param``
tags between two :meth:`CommStats.snapshot` calls.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Counters of collective calls: ``calls[(op, tag)]``, ``elements[(op, tag)]``, ``bytes[(op, tag)]``."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    elements: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)

    def record(self, op: str, tag: str, tensor: torch.Tensor) -> None:
        """Count one call of ``op`` moving the full buffer ``tensor``."""
        key = (op, tag)
        self.calls[key] += 1
        self.elements[key] += tensor.numel()
        self.bytes[key] += tensor.numel() * tensor.element_size()

    def total_elements(self, tags: tuple[str, ...] = ("grad", "param"), ops: tuple[str, ...] | None = None) -> int:
        """Elements moved by calls whose tag is in ``tags`` (and op in ``ops`` when given)."""
        return sum(n for (op, tag), n in self.elements.items() if tag in tags and (ops is None or op in ops))

    def snapshot(self) -> dict[str, int]:
        """A flat copy ``{"op:tag": elements}`` (diff two snapshots to count one step)."""
        return {f"{op}:{tag}": n for (op, tag), n in self.elements.items()}

    def reset(self) -> None:
        """Zero every counter."""
        self.calls.clear()
        self.elements.clear()
        self.bytes.clear()


# torch >= 2.13 renamed the single-tensor collectives (the old names warn); use whichever exists.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

GLOBAL_COMM_STATS = CommStats()
"""Counts every collective issued by any elasticzero ZeRO optimizer or :class:`GradBucketer` in this process."""


def _record(stats: CommStats | None, op: str, tag: str, tensor: torch.Tensor) -> None:
    GLOBAL_COMM_STATS.record(op, tag, tensor)
    if stats is not None and stats is not GLOBAL_COMM_STATS:
        stats.record(op, tag, tensor)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    *,
    stats: CommStats | None = None,
    tag: str = "grad",
    async_op: bool = False,
) -> Any:
    """Sum ``input`` (``world_size * output.numel()`` elements) over ranks; this rank's chunk lands in ``output``."""
    _record(stats, "reduce_scatter", tag, input)
    return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    *,
    stats: CommStats | None = None,
    tag: str = "param",
    async_op: bool = False,
) -> Any:
    """Concatenate every rank's ``input`` into ``output`` (``input`` may be this rank's chunk of ``output``)."""
    _record(stats, "all_gather", tag, output)
    return _all_gather(output, input, group=group, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor,
    group: Any,
    *,
    op: Any = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    tag: str = "grad",
    async_op: bool = False,
) -> Any:
    """Reduce ``tensor`` in place over ranks with ``op`` (SUM by default)."""
    _record(stats, "all_reduce", tag, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: Any, *, stats: CommStats | None = None) -> None:
    """Copy ``tensor`` from group rank ``src_group_rank`` to every rank (tag ``"init"``)."""
    _record(stats, "broadcast", "init", tensor)
    dist.broadcast(tensor, group=group, group_src=src_group_rank)
