"""Flat layout and element-granular partition (pure, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero.engine.zero.flat import build_buckets, flatten_into, view_params_into


def _params(*numels: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.arange(n, dtype=dtype) + 100 * i)) for i, n in enumerate(numels)]


def test_buckets_bounded_by_bytes_large_alone_in_registration_order() -> None:
    named = _params(3, 100, 5, 7, 6)  # 100 fp32 elements = 400 bytes >= the 64-byte bound: alone
    buckets = build_buckets(named, bucket_bytes=64, world_size=2, rank=0)
    assert [b.names for b in buckets] == [("p0",), ("p1",), ("p2", "p3"), ("p4",)]
    assert all(sum(p.numel() * 4 for p in b.params) <= 64 for b in buckets if len(b.params) > 1)


def test_buckets_keyed_by_dtype() -> None:
    named = _params(2, 2) + [("h0", nn.Parameter(torch.ones(3, dtype=torch.float16)))] + _params(2)[:1]
    named[-1] = ("p9", named[-1][1])
    buckets = build_buckets(named, bucket_bytes=1 << 20, world_size=2, rank=0)
    assert [b.names for b in buckets] == [("p0", "p1", "p9"), ("h0",)]
    assert {b.key for b in buckets} == {torch.float32, torch.float16}


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_partition_balanced_to_one_element_and_covers_every_param(world: int) -> None:
    numels = (1, 5, 11, 2, 3)  # includes params smaller than the world size
    for rank in range(world):
        buckets = build_buckets(_params(*numels), bucket_bytes=1 << 20, world_size=world, rank=rank)
        (b,) = buckets
        assert b.padded_numel - b.numel < world
        assert b.shard_numel * world == b.padded_numel
    covered: dict[str, list[int]] = {f"p{i}": [0] * n for i, n in enumerate(numels)}
    for rank in range(world):
        (b,) = build_buckets(_params(*numels), bucket_bytes=1 << 20, world_size=world, rank=rank)
        lo, _ = b.shard_range()
        for name, start, end, shard_off in b.local_pieces():
            assert b.offsets[b.names.index(name)] + start == lo + shard_off
            for e in range(start, end):
                covered[name][e] += 1
    assert all(c == [1] * len(c) for c in covered.values())  # every element owned by exactly one rank


def test_slots_give_global_offsets_across_buckets() -> None:
    buckets = build_buckets(_params(3, 100, 5), bucket_bytes=64, world_size=3, rank=1)
    slots = {s.name: s for b in buckets for s in b.slots()}
    assert [(slots[n].global_offset, slots[n].numel) for n in ("p0", "p1", "p2")] == [(0, 3), (3, 100), (105, 5)]
    assert slots["p1"].shape == torch.Size([100])


def test_params_become_views_of_the_flat_buffer() -> None:
    named = [("w", nn.Parameter(torch.randn(2, 3))), ("b", nn.Parameter(torch.randn(3)))]
    originals = [p.detach().clone() for _, p in named]
    (b,) = build_buckets(named, bucket_bytes=1 << 20, world_size=4, rank=0)
    flat = torch.full((b.padded_numel,), 7.0)
    flatten_into(b, flat)
    view_params_into(b, flat)
    assert flat[b.numel :].eq(0).all()
    for (_, p), o in zip(named, originals, strict=True):
        assert torch.equal(p, o)
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    flat.add_(1)
    assert torch.equal(named[0][1], originals[0] + 1)
