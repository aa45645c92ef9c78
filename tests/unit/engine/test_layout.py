"""The typed ZeRO layout (engine/zero/layout.py) and the sharded state built over it (engine/zero/sharded.py): pure
arithmetic checked element by element against a brute-force map, at several world sizes and uneven sizes; then the
stages' public sharded state on a world-size-1 group."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.zero.layout import FlatChunk, Piece, ZeroLayout
from elasticzero.engine.zero.sharded import Origin, ShardedState, check_record
from elasticzero.engine.zero.stage3 import UnitPlan
from elasticzero.errors import UsageError

# three buckets: sizes smaller than, equal to and far from multiples of the world sizes below; a 0-dim parameter
BUCKETS = [
    [("a", (1,)), ("b", (2, 3)), ("c", ())],
    [("d", (11,))],
    [("e", (3, 1, 2)), ("f", (5,)), ("g", (2,))],
]
WORLDS = [1, 2, 3, 4, 7, 16]


def _layout(world: int) -> ZeroLayout:
    return ZeroLayout.of(BUCKETS, world, groups=[0, 1, 0])


def _global_values(layout: ZeroLayout) -> torch.Tensor:
    """The global flat index space filled with each element's (parameter number * 100 + element index); -1 padding."""
    flat = torch.full((sum(b.padded_numel for b in layout.buckets),), -1.0)
    for i, s in enumerate(layout.params.values()):
        flat[s.global_offset : s.global_offset + s.numel] = 100 * i + torch.arange(s.numel, dtype=torch.float32)
    return flat


@pytest.mark.parametrize("world", WORLDS)
def test_pieces_cover_every_element_exactly_once_across_ranks(world: int) -> None:
    layout = _layout(world)
    owners: dict[str, list[int]] = {n: [0] * s.numel for n, s in layout.params.items()}
    for rank in range(world):
        for name, piece in layout.pieces(rank).items():
            assert piece.name == name and 0 <= piece.start < piece.end <= layout.params[name].numel
            for e in range(piece.start, piece.end):
                owners[name][e] += 1
    assert owners == {n: [1] * s.numel for n, s in layout.params.items()}


@pytest.mark.parametrize("world", WORLDS)
def test_shards_are_equal_contiguous_and_balanced_to_one_element(world: int) -> None:
    layout = _layout(world)
    at = 0
    for b in layout.buckets:
        assert b.global_offset == at and b.padded_numel % world == 0 and b.padded_numel - b.numel < world
        assert [b.shard_range(r) for r in range(world)] == [
            (r * b.shard_numel, (r + 1) * b.shard_numel) for r in range(world)
        ]
        at += b.padded_numel
    assert layout.numel == sum(math.prod(shape) for bucket in BUCKETS for _, shape in bucket)


@pytest.mark.parametrize("world", WORLDS)
def test_chunks_view_the_right_elements_of_each_rank_shard(world: int) -> None:
    layout = _layout(world)
    flat = _global_values(layout)
    for rank in range(world):
        shards = [flat[b.global_offset :][slice(*b.shard_range(rank))] for b in layout.buckets]
        chunks = layout.chunks(rank, shards)
        assert set(chunks) == set(layout.pieces(rank))
        for name, chunk in chunks.items():
            i, slot = list(layout.params).index(name), layout.params[name]
            want = 100 * i + torch.arange(chunk.offset, chunk.offset + chunk.tensor.numel(), dtype=torch.float32)
            assert chunk.numel == slot.numel and torch.equal(chunk.tensor, want)
            assert chunk.tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view


def test_groups_slots_and_whole() -> None:
    layout = _layout(3)
    assert layout.group_buckets(0) == (0, 2) and layout.group_buckets(1) == (1,)
    assert layout.params["b"].shape == torch.Size([2, 3]) and layout.params["c"].numel == 1
    assert [(s.bucket, s.offset) for s in layout.params.values()] == [
        (0, 0),
        (0, 1),
        (0, 7),
        (1, 0),
        (2, 0),
        (2, 6),
        (2, 11),
    ]
    whole = ZeroLayout.whole([(n, s) for bucket in BUCKETS for n, s in bucket])
    assert whole.world_size == 1 and whole.numel == layout.numel
    assert whole.pieces(0) == {n: Piece(n, 0, s.numel, 0) for n, s in layout.params.items()}


def _sharded(world: int, rank: int) -> ShardedState:
    layout = _layout(world)
    flat = _global_values(layout)
    masters = [flat[b.global_offset :][slice(*b.shard_range(rank))] for b in layout.buckets]
    states = [{"exp_avg": m * 2, "step": torch.tensor(3.0)} for m in masters]
    return ShardedState.of(
        layout,
        rank,
        masters,
        states,
        origin=Origin(2, world, "bfloat16", "AdamW"),
        aliases={"tied": "a"},
        param_groups=[{"params": [], "lr": 0.1}, {"params": [], "lr": 0.2}],
        module={"buf": torch.ones(2)},
    )


def test_sharded_state_tree_round_trips_and_records_the_layout() -> None:
    state = _sharded(world=3, rank=1)
    sd = state.state_dict()
    assert sd["layout"] == {
        "format": 1,
        "stage": 2,
        "world_size": 3,
        "precision": "bfloat16",
        "optimizer": "AdamW",
        "numel": state.layout.numel,
        "shapes": [[n, list(s.shape)] for n, s in state.layout.params.items()],
        "aliases": [["tied", "a"]],
    }
    assert sd["optim"]["param_groups"] == {"0": {"lr": 0.1}, "1": {"lr": 0.2}}
    assert sd["optim"]["scalars"] == {"step": [[n, 3.0] for n in state.layout.params]}  # every parameter, every rank
    for name, chunk in sd["params"].items():
        assert isinstance(chunk, FlatChunk)
        assert torch.equal(sd["optim"]["state"][name]["exp_avg"].tensor, chunk.tensor * 2)
    back = ShardedState.from_state_dict(sd, state.layout)
    assert back == state  # the same chunk objects; scalars, groups, origin and aliases read back equal


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"d": [11]}, "parameters only here"),
        ({**{n: list(s) for bucket in BUCKETS for n, s in bucket}, "d": [12]}, "d has shape"),
    ],
)
def test_a_record_of_another_model_is_refused(shapes: dict[str, Any], message: str) -> None:
    record = _sharded(2, 0).state_dict()["layout"]
    check_record(record, _layout(5))  # another world size: fits
    with pytest.raises(UsageError, match=message):
        check_record({**record, "shapes": [[n, s] for n, s in shapes.items()]}, _layout(2))
    with pytest.raises(UsageError, match="format 2"):
        check_record({**record, "format": 2}, _layout(2))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 3)])
        self.head = nn.Linear(3, 2)
        self.register_buffer("scale", torch.full((2,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x).tanh()
        return self.head(x) * self.scale


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2, ZeroStage3])
def test_every_stage_shares_the_same_per_parameter_state(group: None, stage: Any) -> None:
    """Another bucketing (stage 3: one bucket per unit) lays the same parameters out in the same per-parameter index
    space: the sharded state per parameter name is the model's, whatever the stage."""
    torch.manual_seed(0)
    model = _Net()
    want = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    opt = stage(model, torch.optim.AdamW, lr=1e-2, bucket_bytes=64)
    state = opt.sharded_state()
    assert state.layout is opt.layout and opt.partition is opt.layout.params
    assert state.params.keys() == want.keys()
    assert all(torch.equal(state.params[n].tensor, t) and state.params[n].offset == 0 for n, t in want.items())
    assert state.optim_state == {n: {} for n in want}  # nothing stepped yet: no optimizer state
    assert state.module.keys() == {"scale"} and state.origin == opt.origin
    if stage is ZeroStage3:
        assert len(opt.buckets) == 3  # two ModuleList blocks and the root (the head)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied: registered by embed and head
        self.blocks[0].bias.data = self.blocks[0].bias.data.double()  # another dtype inside a unit


def test_stage3_units_are_decided_from_the_module_alone() -> None:
    """Stage 3's bucketing needs no optimizer (it is passed to the base before anything is built): ModuleList blocks
    are units, a tied weight belongs to the nearest unit enclosing every module registering it (the root), and a
    unit's parameters split by key (here: dtype)."""
    model = _Tied()
    plan = UnitPlan.of(model, None)
    assert plan.units == ("", "blocks.0", "blocks.1")
    groups = plan.groups(list(model.named_parameters()), key=lambda p: p.dtype)
    assert [[n for n, _ in g] for g in groups] == [
        ["embed.weight"],
        ["blocks.0.weight"],
        ["blocks.0.bias"],
        ["blocks.1.weight"],
    ]
