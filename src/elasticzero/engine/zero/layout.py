"""What every rank of a ZeRO optimizer owns, as plain immutable data, and the element ranges that state travels in.

All three stages lay trainable parameters out the same way: in order, into *buckets*, each one flat index space
holding its parameters back to back, padded at the end to a multiple of ``world_size`` and cut into equal contiguous
shards (rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``). Shards are balanced to one element; a parameter
may straddle ranks, and one smaller than the world size lives on one or two ranks only. The *global flat index space*
concatenates the padded buckets in bucket order.

- :class:`ParamSlot`: where one parameter lives (bucket, offset in it, offset in the global space, numel, shape).
- :class:`BucketLayout`: one bucket: its slots, its optimizer parameter group, its padding and shards.
- :class:`ZeroLayout`: every bucket of an optimizer at one world size; what rank ``r`` owns of each parameter
  (:meth:`ZeroLayout.pieces`) is the same arithmetic on every rank, so any rank can compute any other rank's share.
- :class:`Piece`: elements ``[start, end)`` of one flattened parameter, found at ``shard_offset`` in a rank's shard.
- :class:`FlatChunk`: such a range with the tensor holding it: the state-dict leaf a checkpoint writes at its offset
  (the DCP planners of :mod:`elasticzero.checkpoint.planner`) and the unit an in-memory reshard moves.

This module holds no live tensors of an optimizer and imports nothing of elasticzero: the engine's stages and the
checkpoint code (which imports the engine, never the reverse) share it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where parameter ``name`` lives: ``bucket`` index, ``offset`` inside the bucket, ``global_offset`` overall."""

    name: str
    bucket: int
    offset: int
    numel: int
    shape: torch.Size
    global_offset: int


class Piece(NamedTuple):
    """Elements ``[start, end)`` of the flattened parameter ``name``, at ``shard_offset`` in a rank's bucket shard."""

    name: str
    start: int
    end: int
    shard_offset: int


@dataclass(frozen=True)
class BucketLayout:
    """One flat bucket: its parameters' slots (in order, back to back), the optimizer parameter ``group`` they belong
    to, and how it is padded and cut into ``world_size`` equal shards."""

    index: int
    slots: tuple[ParamSlot, ...]
    world_size: int
    global_offset: int = 0
    group: int = 0

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(s.offset for s in self.slots)

    @cached_property
    def numel(self) -> int:
        """Elements of its parameters (padding excluded)."""
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    @property
    def padded_numel(self) -> int:
        """``numel`` rounded up to a multiple of ``world_size``."""
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        """Elements every rank owns (equal on all ranks; the last rank's tail may be padding)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard inside the bucket."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """What ``rank`` owns of each parameter of the bucket (parameters it owns nothing of are left out)."""
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(Piece(s.name, a - s.offset, b - s.offset, a - lo))
        return tuple(out)

    def chunks(self, rank: int, shard: torch.Tensor) -> dict[str, FlatChunk]:
        """``{name: FlatChunk}`` over ``shard`` (a tensor laid out as ``rank``'s shard of this bucket): views of the
        elements it holds of each parameter, at their offsets in the flattened parameter."""
        numel = {s.name: s.numel for s in self.slots}
        return {
            p.name: FlatChunk(shard[p.shard_offset : p.shard_offset + p.end - p.start], p.start, numel[p.name])
            for p in self.pieces(rank)
        }


@dataclass(frozen=True)
class ZeroLayout:
    """Every bucket of a ZeRO optimizer at ``world_size`` ranks: who owns which elements of every parameter.

    Equal on every rank of the group (it depends on the model, the parameter groups, the bucketing and the world size
    only). Two layouts of the same parameters — another world size, another stage's bucketing — describe the same
    per-parameter index space, which is what a checkpoint (and an in-memory reshard) maps one onto the other by."""

    world_size: int
    buckets: tuple[BucketLayout, ...]

    @classmethod
    def of(
        cls, buckets: Sequence[Sequence[tuple[str, Sequence[int]]]], world_size: int, groups: Sequence[int] = ()
    ) -> ZeroLayout:
        """Lay ``buckets`` (in order, each a list of its parameters' ``(name, shape)``) out back to back; bucket ``i``
        belongs to optimizer parameter group ``groups[i]`` (default 0)."""
        out: list[BucketLayout] = []
        global_offset = 0
        for i, params in enumerate(buckets):
            slots, at = [], 0
            for name, shape in params:
                numel = math.prod(shape)
                slots.append(ParamSlot(name, i, at, numel, torch.Size(shape), global_offset + at))
                at += numel
            out.append(BucketLayout(i, tuple(slots), world_size, global_offset, groups[i] if groups else 0))
            global_offset += out[-1].padded_numel
        return cls(world_size, tuple(out))

    @classmethod
    def whole(cls, shapes: Iterable[tuple[str, Sequence[int]]]) -> ZeroLayout:
        """Each parameter whole, in a bucket of its own, at world size 1: state held by one process (an import)."""
        return cls.of([[(name, torch.Size(shape))] for name, shape in shapes], world_size=1)

    @cached_property
    def params(self) -> dict[str, ParamSlot]:
        """``{name: ParamSlot}`` of every parameter, in bucket order."""
        return {s.name: s for b in self.buckets for s in b.slots}

    @cached_property
    def numel(self) -> int:
        """Elements of all parameters (padding excluded)."""
        return sum(b.numel for b in self.buckets)

    def group_buckets(self, group: int) -> tuple[int, ...]:
        """Indices of the buckets of optimizer parameter group ``group``."""
        return tuple(b.index for b in self.buckets if b.group == group)

    def pieces(self, rank: int) -> dict[str, Piece]:
        """``{name: Piece}``: what ``rank`` owns of each parameter (at most one contiguous range each: a parameter
        lives in one bucket and a shard is contiguous); parameters it owns nothing of are left out."""
        return {p.name: p for b in self.buckets for p in b.pieces(rank)}

    def chunks(self, rank: int, shards: Sequence[torch.Tensor]) -> dict[str, FlatChunk]:
        """``{name: FlatChunk}`` over ``shards`` (one tensor per bucket, laid out as ``rank``'s shard of it)."""
        return {n: c for b, shard in zip(self.buckets, shards, strict=True) for n, c in b.chunks(rank, shard).items()}


@dataclass
class FlatChunk:
    """Elements ``[offset, offset + tensor.numel())`` of a flattened tensor of ``numel`` elements (1-D ``tensor``).

    A ZeRO rank owns, of every parameter, at most one contiguous range of its flattened elements (a :class:`Piece`);
    this puts such a range, with the tensor holding it, into a state dict. DTensor cannot say "elements 37..91" (its
    shards follow placements over a mesh), ShardedTensor is deprecated: this is the plain description DCP's metadata
    already speaks (``ChunkStorageMetadata`` offsets and sizes)."""

    tensor: torch.Tensor
    offset: int
    numel: int

    def __post_init__(self) -> None:
        if self.tensor.dim() != 1 or not 0 <= self.offset <= self.offset + self.tensor.numel() <= self.numel:
            raise ValueError(
                f"FlatChunk: a 1-D tensor inside [0, {self.numel}) expected, got shape {tuple(self.tensor.shape)} "
                f"at offset {self.offset}"
            )

    def with_tensor(self, tensor: torch.Tensor) -> FlatChunk:
        """The same range over another tensor (a snapshot copy, a fresh load buffer)."""
        return FlatChunk(tensor, self.offset, self.numel)
