"""Flat buffers and the element-granular partition.

Trainable parameters are laid out, in registration order, into *buckets*: each bucket is one flat 1-D buffer holding
its parameters back to back, padded at the end to a multiple of ``world_size`` so that every rank owns exactly
``shard_numel = padded_numel // world_size`` contiguous elements of it (rank ``r`` owns
``[r * shard_numel, (r + 1) * shard_numel)``). Shards are balanced to one element; a parameter may straddle ranks, and
a parameter smaller than the world size lives on one or two ranks only.

The *global flat index space* concatenates the padded buckets in bucket order; :class:`ParamSlot` gives every
parameter name its ``(offset, numel)`` there (and inside its bucket), which is what a checkpoint needs to map this
rank's shard back to parameter names (:func:`local_pieces`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from elasticzero.errors import UsageError


@dataclass(frozen=True)
class ParamSlot:
    """Where parameter ``name`` lives: ``bucket`` index, ``offset`` inside the bucket, ``global_offset`` overall."""

    name: str
    bucket: int
    offset: int
    numel: int
    shape: torch.Size
    global_offset: int


@dataclass
class FlatBucket:
    """One flat buffer's layout: parameters (registration order), their offsets, padding and this rank's shard."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    world_size: int
    rank: int
    key: Hashable = None  # what the bucket is keyed by (param group index, dtype)
    global_offset: int = 0
    extra: dict[str, object] = field(default_factory=dict)  # per-stage scratch (buffers, handles)

    @property
    def padded_numel(self) -> int:
        """``numel`` rounded up to a multiple of ``world_size``."""
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        """Elements every rank owns (equal on all ranks; the last rank's tail may be padding)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s (default: this rank's) shard inside the bucket."""
        r = self.rank if rank is None else rank
        return r * self.shard_numel, (r + 1) * self.shard_numel

    def slots(self) -> list[ParamSlot]:
        """One :class:`ParamSlot` per parameter of this bucket."""
        return [
            ParamSlot(name, self.index, off, p.numel(), p.shape, self.global_offset + off)
            for name, p, off in zip(self.names, self.params, self.offsets, strict=True)
        ]

    def local_pieces(self, rank: int | None = None) -> list[tuple[str, int, int, int]]:
        """``(name, start, end, shard_offset)``: elements ``[start, end)`` of the flattened parameter ``name`` are
        owned by ``rank`` and sit at ``shard_offset`` in its shard."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for name, p, off in zip(self.names, self.params, self.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                pieces.append((name, a - off, b - off, a - lo))
        return pieces


def build_buckets(
    named_params: Sequence[tuple[str, nn.Parameter]],
    *,
    bucket_bytes: int,
    world_size: int,
    rank: int,
    key: Callable[[nn.Parameter], Hashable] = lambda p: p.dtype,
    elem_size: Callable[[nn.Parameter], int] = lambda p: p.element_size(),
) -> list[FlatBucket]:
    """Group parameters (in the given, registration order) into buckets of at most ``bucket_bytes``.

    A parameter joins the open bucket of its ``key`` (dtype by default) unless that would exceed ``bucket_bytes``, in
    which case the open bucket is closed first; a parameter of ``bucket_bytes`` or more gets a bucket of its own (and
    closes the open bucket of its key, so each bucket holds parameters adjacent in registration order per key).
    Buckets are numbered by their first parameter's registration position, identically on every rank.
    """
    groups: list[list[tuple[str, nn.Parameter]]] = []
    open_group: dict[Hashable, int] = {}
    open_bytes: dict[Hashable, int] = {}
    for name, p in named_params:
        k, nbytes = key(p), p.numel() * elem_size(p)
        if nbytes >= bucket_bytes:  # alone; closes the open bucket so buckets stay contiguous per key
            open_group.pop(k, None)
            groups.append([(name, p)])
            continue
        if k in open_group and open_bytes[k] + nbytes > bucket_bytes:
            del open_group[k]
        if k not in open_group:
            open_group[k], open_bytes[k] = len(groups), 0
            groups.append([])
        groups[open_group[k]].append((name, p))
        open_bytes[k] += nbytes
    return layout_buckets(groups, world_size=world_size, rank=rank, key=key)


def layout_buckets(
    groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
    *,
    world_size: int,
    rank: int,
    key: Callable[[nn.Parameter], Hashable] = lambda p: p.dtype,
) -> list[FlatBucket]:
    """Turn explicit parameter groups (one per bucket, in order) into :class:`FlatBucket` layouts."""
    buckets: list[FlatBucket] = []
    global_offset = 0
    for i, group in enumerate(g for g in groups if g):
        offsets, total = [], 0
        for _, p in group:
            offsets.append(total)
            total += p.numel()
        b = FlatBucket(
            index=i,
            params=[p for _, p in group],
            names=[n for n, _ in group],
            offsets=offsets,
            numel=total,
            world_size=world_size,
            rank=rank,
            key=key(group[0][1]),
            global_offset=global_offset,
        )
        buckets.append(b)
        global_offset += b.padded_numel
    return buckets


def _device_of(params: Iterable[torch.Tensor]) -> torch.device:
    """The one device all ``params`` live on (flat buffers are allocated there); :class:`UsageError` if they span
    several devices or there are none."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        found = ", ".join(sorted(str(d) for d in devices)) or "none"
        raise UsageError(
            f"the parameters a flat buffer serves must share one device, found: {found}; move the module to one "
            "device (module.to(device)) before wrapping it"
        )
    return devices.pop()


def flatten_into(bucket: FlatBucket, out: torch.Tensor, tensors: Sequence[torch.Tensor] | None = None) -> None:
    """Copy the bucket's parameters (or ``tensors``, same order) into the flat ``out``; padding is zeroed."""
    src = bucket.params if tensors is None else tensors
    with torch.no_grad():
        for t, off in zip(src, bucket.offsets, strict=True):
            out[off : off + t.numel()].copy_(t.reshape(-1))
        out[bucket.numel :].zero_()


def view_params_into(bucket: FlatBucket, flat: torch.Tensor) -> None:
    """Make every parameter of the bucket a view into ``flat`` (``param.data`` swap; identity kept)."""
    for p, off in zip(bucket.params, bucket.offsets, strict=True):
        p.data = flat[off : off + p.numel()].view(p.shape)
