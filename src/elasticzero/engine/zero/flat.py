"""Flat buffers: the live side of :mod:`~elasticzero.engine.zero.layout`.

A :class:`FlatBucket` binds one :class:`~elasticzero.engine.zero.layout.BucketLayout` (pure geometry, equal on every
rank) to the ``nn.Parameter`` s it serves and to this rank. :func:`size_groups` is the stage-1/2 bucketing (by bytes,
per key, in registration order); a stage passes its bucketing to the base as a :class:`Grouping`, and
:func:`layout_buckets` turns the groups into buckets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from elasticzero.engine.zero.layout import BucketLayout, ParamSlot, Piece, ZeroLayout
from elasticzero.errors import UsageError

Named = Sequence[tuple[str, nn.Parameter]]


class Grouping(Protocol):
    """How trainable parameters (``named``, registration order) form buckets: one list per bucket, in bucket order;
    parameters of one bucket share their ``key``."""

    def __call__(
        self, named: Named, key: Callable[[nn.Parameter], Hashable]
    ) -> list[list[tuple[str, nn.Parameter]]]: ...


@dataclass
class FlatBucket:
    """One flat buffer: its ``layout`` (equal on every rank), the parameters it serves (in the layout's order), this
    ``rank``, and the ``key`` its parameters share (param group index, dtype...)."""

    layout: BucketLayout
    params: list[nn.Parameter]
    rank: int
    key: Hashable = None

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.layout.offsets

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def global_offset(self) -> int:
        return self.layout.global_offset

    @property
    def padded_numel(self) -> int:
        """``numel`` rounded up to a multiple of ``world_size``."""
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        """Elements every rank owns (equal on all ranks; the last rank's tail may be padding)."""
        return self.layout.shard_numel

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s (default: this rank's) shard inside the bucket."""
        return self.layout.shard_range(self.rank if rank is None else rank)

    def slots(self) -> tuple[ParamSlot, ...]:
        """One :class:`~elasticzero.engine.zero.layout.ParamSlot` per parameter of this bucket."""
        return self.layout.slots

    def local_pieces(self, rank: int | None = None) -> tuple[Piece, ...]:
        """``Piece(name, start, end, shard_offset)``: elements ``[start, end)`` of the flattened parameter ``name``
        are owned by ``rank`` (default: this rank) and sit at ``shard_offset`` in its shard."""
        return self.layout.pieces(self.rank if rank is None else rank)


def size_groups(
    named: Named,
    key: Callable[[nn.Parameter], Hashable],
    *,
    bucket_bytes: int,
    elem_size: Callable[[nn.Parameter], int] = lambda p: p.element_size(),
) -> list[list[tuple[str, nn.Parameter]]]:
    """Group parameters (in the given, registration order) into buckets of at most ``bucket_bytes``.

    A parameter joins the open bucket of its ``key`` unless that would exceed ``bucket_bytes``, in which case the open
    bucket is closed first; a parameter of ``bucket_bytes`` or more gets a bucket of its own (and closes the open
    bucket of its key, so each bucket holds parameters adjacent in registration order per key). Buckets are numbered
    by their first parameter's registration position, identically on every rank.
    """
    groups: list[list[tuple[str, nn.Parameter]]] = []
    open_group: dict[Hashable, int] = {}
    open_bytes: dict[Hashable, int] = {}
    for name, p in named:
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
    return groups


def build_buckets(
    named: Named,
    *,
    bucket_bytes: int,
    world_size: int,
    rank: int,
    key: Callable[[nn.Parameter], Hashable] = lambda p: p.dtype,
    elem_size: Callable[[nn.Parameter], int] = lambda p: p.element_size(),
) -> list[FlatBucket]:
    """:func:`size_groups` (dtype as the default key) laid out by :func:`layout_buckets`."""
    groups = size_groups(named, key, bucket_bytes=bucket_bytes, elem_size=elem_size)
    return layout_buckets(groups, world_size=world_size, rank=rank, key=key)


def layout_buckets(
    groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
    *,
    world_size: int,
    rank: int,
    key: Callable[[nn.Parameter], Hashable] = lambda p: p.dtype,
    group: Callable[[nn.Parameter], int] = lambda p: 0,
) -> list[FlatBucket]:
    """Turn explicit parameter groups (one per bucket, in order; empty ones dropped) into :class:`FlatBucket` s;
    ``group(p)`` is the optimizer parameter group of a bucket's parameters."""
    kept = [g for g in groups if g]
    layout = ZeroLayout.of([[(n, p.shape) for n, p in g] for g in kept], world_size, [group(g[0][1]) for g in kept])
    return [FlatBucket(b, [p for _, p in g], rank, key(g[0][1])) for b, g in zip(layout.buckets, kept, strict=True)]


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


def storage_users(module: nn.Module) -> Counter[int]:
    """How many of ``module``'s parameters and buffers view each storage (by its address; empty tensors left out)."""
    tensors = [*module.parameters(), *module.buffers()]
    return Counter(t.untyped_storage().data_ptr() for t in tensors if t.numel())


#: The attribute a stage-1/2 optimizer sets on every parameter it lays into an fp32 buffer it made (:func:`mark_flat`):
#: that buffer's storage address. A later wrap takes a buffer over only where each parameter still views the buffer it
#: was laid in (:func:`lying_flat`) — never a user's own storage that happens to fit (a parameter viewing part of a
#: larger tensor: zeroing the bucket's padding would write that tensor).
FLAT_MARK = "_elasticzero_flat"


def mark_flat(bucket: FlatBucket, flat: torch.Tensor) -> None:
    """Mark ``bucket``'s parameters as laid into ``flat``, a buffer this engine made (:data:`FLAT_MARK`)."""
    address = flat.untyped_storage().data_ptr()
    for p in bucket.params:
        setattr(p, FLAT_MARK, address)


def lying_flat(bucket: FlatBucket, users: Mapping[int, int]) -> torch.Tensor | None:
    """The buffer ``bucket``'s parameters already lie in as the bucket lays them out — its first ``padded_numel``
    elements — or None. They do when every one is still in the buffer an optimizer of this engine laid it in
    (:data:`FLAT_MARK`), a contiguous view of that storage at its offset in the bucket from the storage's first
    element, nothing else of the module views that storage (``users``: :func:`storage_users`), and the storage has
    room for the bucket's padding: a module another stage-1/2 optimizer handed back without a copy
    (:meth:`~elasticzero.engine.zero.base.ZeroOptimizer.unwrap`, ``copy=False``) is wrapped again in place."""
    first = bucket.params[0]
    storage = first.untyped_storage()
    if users.get(storage.data_ptr()) != len(bucket.params) or storage.nbytes() < bucket.padded_numel * first.itemsize:
        return None
    for p, off in zip(bucket.params, bucket.offsets, strict=True):
        same = p.untyped_storage().data_ptr() == storage.data_ptr() == getattr(p, FLAT_MARK, None)
        if not (same and p.dtype == first.dtype and p.is_contiguous() and p.storage_offset() == off):
            return None
    return torch.as_strided(first.detach(), (bucket.padded_numel,), (1,), 0)


def new_flat(bucket: FlatBucket, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of ``bucket.padded_numel`` elements whose storage has room for any world up to twice and one more
    than this one's padding (``2 * world_size`` elements more): a later wrap at such a world takes it over in place
    (:func:`lying_flat`)."""
    room = 2 * bucket.world_size
    return torch.empty(bucket.padded_numel + room, dtype=dtype, device=device)[: bucket.padded_numel]


def view_params_into(bucket: FlatBucket, flat: torch.Tensor) -> None:
    """Make every parameter of the bucket a view into ``flat`` (``param.data`` swap; identity kept)."""
    for p, off in zip(bucket.params, bucket.offsets, strict=True):
        p.data = flat[off : off + p.numel()].view(p.shape)
