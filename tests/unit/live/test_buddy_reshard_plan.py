"""Buddy placement (live/buddy.py) and the in-memory reshard plan (live/reshard.py): pure decisions,
checked against brute force — every rank's copy on another node, every element of every parameter delivered exactly
once from a rank that holds it, a loss of both copies of a shard (or no common step) reported as a fallback."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero.engine.zero.flat import layout_buckets, size_groups
from elasticzero.engine.zero.layout import FlatChunk, ZeroLayout
from elasticzero.engine.zero.stage3 import UnitPlan
from elasticzero.errors import UsageError
from elasticzero.live.buddy import BuddyPlan, place_buddies
from elasticzero.live.reshard import (
    Fallback,
    Report,
    ReshardPlan,
    Transfer,
    _joined,
    _outgoing,
    _slice,
    choose_sources,
    message_runs,
    plan_reshard,
    served_by,
)

CPU = torch.device("cpu")
SHAPES = [("a", (1,)), ("b", (2, 3)), ("c", ()), ("d", (11,)), ("e", (3, 1, 2)), ("f", (5,)), ("g", (2,))]
# the same parameters bucketed three ways: by size (stages 1/2), one unit per parameter (stage 3), all in one
BUCKETINGS = {
    "by_size": [SHAPES[:3], SHAPES[3:4], SHAPES[4:]],
    "units": [[s] for s in SHAPES],
    "one": [SHAPES],
}


def _layout(bucketing: str, world: int) -> ZeroLayout:
    return ZeroLayout.of(BUCKETINGS[bucketing], world)


# -- placement ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nodes",
    [[0, 1], [0, 0, 1, 1], [0, 1, 2], [0, 0, 1, 1, 2, 2], ["h1", "h1", "h1", "h2"], [5, 5, 7, 7, 7, 9], [1, 0, 1, 0]],
)
@pytest.mark.parametrize("shift", [1, 2])
def test_every_copy_is_on_another_node(nodes: list[object], shift: int) -> None:
    plan = place_buddies(nodes, node_shift=shift)
    assert plan.enabled
    # a shift that is a multiple of the round's node count falls back to 1 for that round, and says so
    assert ("shift 1" in plan.reason) == (shift % len(set(nodes)) == 0)
    if plan.reason:
        assert plan.holder == place_buddies(nodes).holder
    for r, h in enumerate(plan.holder):
        assert h is not None and nodes[h] != nodes[r], (r, h)
    assert sorted(r for h in range(len(nodes)) for r in plan.wards(h)) == list(range(len(nodes)))


def test_a_shift_below_one_is_refused_with_the_fix() -> None:
    with pytest.raises(UsageError, match=r"node_shift=0: must be >= 1"):
        place_buddies([0, 1], node_shift=0)


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 2, 3]])
def test_equal_nodes_give_each_rank_one_ward(nodes: list[int]) -> None:
    plan = place_buddies(nodes)
    assert sorted(h for h in plan.holder if h is not None) == list(range(len(nodes)))


def test_one_node_or_off_holds_nothing() -> None:
    for plan, why in ((place_buddies([3, 3, 3]), "one node"), (place_buddies([0, 1], enabled=False), "off")):
        assert not plan.enabled and plan.holder == (None,) * len(plan.holder) and why in plan.reason
        assert plan.wards(0) == ()


# -- the plan ----------------------------------------------------------------------------------------------------------
def _reports(
    old: ZeroLayout, buddies: BuddyPlan, survivors: Sequence[int | None], steps: dict[int, int] | None = None
) -> list[Report]:
    """Each new rank's report: ``survivors[i]`` its old rank (None: joins), holding its own state and its wards'
    copies, at ``steps`` (default: all at step 3)."""
    steps = steps or {}
    out = []
    for owner in survivors:
        held = () if owner is None else (owner, *buddies.wards(owner))
        out.append(Report(owner, {r: steps.get(r, 3) for r in held}, old if held else None, ("exp_avg",), {}, ()))
    return out


def _check_exactly_once(plan: ReshardPlan, old: ZeroLayout, new: ZeroLayout, reports: Sequence[Report]) -> None:
    got = {n: torch.zeros(s.numel, dtype=torch.int64) for n, s in new.params.items()}
    for t in plan.transfers:
        assert plan.step in [reports[t.src].steps.get(t.old_rank)], t  # the source holds that state, at the step
        src_piece, dst_piece = old.pieces(t.old_rank)[t.name], new.pieces(t.dst)[t.name]
        assert src_piece.start + t.src_offset == t.start and t.end <= src_piece.end, t
        assert dst_piece.start + t.dst_offset == t.start and t.end <= dst_piece.end, t
        got[t.name][t.start : t.end] += 1
    for name, count in got.items():
        assert torch.equal(count, torch.ones_like(count)), (name, count.tolist())


CASES = [  # (old nodes, survivors: old rank or None per new rank)
    ([0, 1, 2], [0, 1]),  # 3 -> 2, rank 2 lost
    ([0, 1, 2], [1, 2]),  # 3 -> 2, rank 0 lost
    ([0, 1, 2, 3], [0, 2, 3]),  # 4 -> 3
    ([0, 0, 1, 1], [0, 1]),  # 4 -> 2, node 1 (ranks 2, 3) lost
    ([0, 0, 1, 1], [2, 3]),  # 4 -> 2, node 0 lost
    ([0, 1], [0, 1, None]),  # 2 -> 3, a node joins
    ([0, 1, 2], [0, None, 2, None]),  # 3 -> 4: one lost, two join
    ([0, 1], [1, 0]),  # same world, ranks renumbered
]


@pytest.mark.parametrize(("old_nodes", "survivors"), CASES)
@pytest.mark.parametrize(
    ("old_bucketing", "new_bucketing"),
    [("by_size", "by_size"), ("units", "units"), ("by_size", "units"), ("one", "units")],
)
def test_every_element_is_delivered_once(
    old_nodes: list[int], survivors: list[int | None], old_bucketing: str, new_bucketing: str
) -> None:
    old, new = _layout(old_bucketing, len(old_nodes)), _layout(new_bucketing, len(survivors))
    reports = _reports(old, place_buddies(old_nodes), survivors)
    plan = plan_reshard(reports, new)
    assert isinstance(plan, ReshardPlan), plan
    _check_exactly_once(plan, old, new, reports)
    for old_rank, src in plan.sources.items():  # a survivor serves its own state, not a copy
        if old_rank in survivors:
            assert survivors[src] == old_rank


def _laid_out(layout: ZeroLayout, rank: int) -> dict[str, Any]:
    """A state tree of ``rank``'s shard of ``layout``, one buffer per bucket (as a live optimizer, a copy and a load
    template lay theirs out), each element its global index in the flattened parameter."""
    bufs = [torch.full((b.shard_numel,), -1.0) for b in layout.buckets]
    chunks = layout.chunks(rank, bufs)
    for c in chunks.values():
        c.tensor.copy_(torch.arange(c.offset, c.offset + c.tensor.numel(), dtype=torch.float32))
    return {"params": chunks}


@pytest.mark.parametrize(("old_nodes", "survivors"), CASES)
@pytest.mark.parametrize(
    ("old_bucketing", "new_bucketing"),
    [("by_size", "by_size"), ("units", "units"), ("by_size", "units"), ("one", "units"), ("one", "one")],
)
def test_messages_are_the_states_own_memory_on_both_sides(
    old_nodes: list[int], survivors: list[int | None], old_bucketing: str, new_bucketing: str
) -> None:
    """``message_runs`` splits a pair's transfers (in order, none left out) into messages that lie back to back in
    the sender's held state and in the receiver's template — one view each side, nothing packed — and no two
    neighbouring messages could be one on both sides (as few messages as the memory allows)."""
    old, new = _layout(old_bucketing, len(old_nodes)), _layout(new_bucketing, len(survivors))
    plan = plan_reshard(_reports(old, place_buddies(old_nodes), survivors), new)
    assert isinstance(plan, ReshardPlan), plan
    held = {r: _laid_out(old, r) for r in range(old.world_size)}
    for src, dst in sorted({(t.src, t.dst) for t in plan.transfers if t.src != t.dst}):
        ts = plan.between(src, dst)
        runs = message_runs(ts, old, new)
        assert [t for run in runs for t in run] == ts
        template = _laid_out(new, dst)
        sides = []
        for run in runs:
            sent = _joined([_slice(held[t.old_rank]["params"][t.name].tensor, t.src_offset, t) for t in run], CPU)
            into = _joined([_slice(template["params"][t.name].tensor, t.dst_offset, t) for t in run], CPU)
            assert sent is not None and into is not None, run
            assert torch.equal(sent, torch.cat([torch.arange(t.start, t.end, dtype=torch.float32) for t in run]))
            assert torch.equal(into, sent)  # the elements the receiver's pieces want, in its layout's order
            sides.append((sent, into))
        for (a_sent, a_into), (b_sent, b_into) in itertools.pairwise(sides):
            one_send = _joined([a_sent, b_sent], CPU) is not None
            assert not (one_send and _joined([a_into, b_into], CPU) is not None)


def test_a_message_is_packed_only_where_its_memory_is_not_one_view() -> None:
    """``_joined``: one view over parts back to back in one storage on the wire; None across a gap, another storage,
    a strided part or another device — where ``_outgoing`` packs the same elements into a buffer of its own."""
    buf = torch.arange(10.0)
    joined = _joined([buf[2:4], buf[4:7]], CPU)
    assert joined is not None and joined.data_ptr() == buf[2:].data_ptr() and torch.equal(joined, buf[2:7])
    assert _joined([buf[2:4], buf[5:7]], CPU) is None  # a gap
    assert _joined([buf[2:4], torch.arange(4.0, 6.0)], CPU) is None  # another storage
    assert _joined([buf[0:6:2]], CPU) is None  # strided
    assert _joined([buf[2:4]], torch.device("meta")) is None  # not on the wire
    ts = [Transfer("w", 0, 0, 1, 2, 4, 2, 0), Transfer("w", 0, 0, 1, 5, 7, 5, 2)]
    trees = {0: {"params": {"w": FlatChunk(buf, 0, 10)}}}
    packed = _outgoing(trees, ts, "params", CPU)
    assert torch.equal(packed, torch.tensor([2.0, 3.0, 5.0, 6.0]))
    assert packed.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    whole = _outgoing(trees, ts[:1], "params", CPU)
    assert whole.data_ptr() == buf[2:].data_ptr()  # sent from the state itself


@pytest.mark.parametrize(("old_nodes", "survivors"), [*CASES, ([0], [0, None]), ([0], [None, 0]), ([0, 1], [0, None])])
def test_served_by_names_the_rank_that_sent_a_whole_state(old_nodes: list[int], survivors: list[int | None]) -> None:
    """``served_by(plan, dst, src)``: every element ``dst`` received came from ``src`` — a joiner whose whole state
    one survivor sent it (its holder then makes its first copy from the same elements, not mirrored back)."""
    old, new = _layout("by_size", len(old_nodes)), _layout("by_size", len(survivors))
    plan = plan_reshard(_reports(old, place_buddies(old_nodes), survivors), new)
    assert isinstance(plan, ReshardPlan), plan
    for dst, src in itertools.product(range(len(survivors)), repeat=2):
        sources = {t.src for t in plan.transfers if t.dst == dst}
        assert served_by(plan, dst, src) == (sources <= {src}), (dst, src, sources)
    if old_nodes == [0]:  # one rank held everything: the joiner got it all from that survivor
        joiner, survivor = survivors.index(None), survivors.index(0)
        assert served_by(plan, joiner, survivor) and not served_by(plan, survivor, joiner)


def test_both_copies_lost_is_a_fallback() -> None:
    buddies = place_buddies([0, 1, 2])  # 0 held by 1, 1 by 2, 2 by 0
    old, new = _layout("by_size", 3), _layout("by_size", 1)
    plan = plan_reshard(_reports(old, buddies, [2]), new)  # ranks 0 and 1 lost: 0's copy was on 1
    assert plan == Fallback("both copies of the state of old rank(s) [0] are lost", (0,))


def test_no_common_step_is_a_fallback_and_the_newest_common_step_wins() -> None:
    buddies = place_buddies([0, 1, 2])
    old, new = _layout("units", 3), _layout("units", 2)
    split = plan_reshard(_reports(old, buddies, [0, 1], {0: 4, 1: 3}), new)  # 1 at 3, 0 (and 2's copy) at 4
    assert isinstance(split, Fallback) and "commit gate" in split.reason and split.missing == ()
    both = [Report(0, {0: 4, 2: 4}, old, (), {}, ()), Report(1, {1: 4, 0: 3}, old, (), {}, ())]
    assert choose_sources(both, 3) == (4, {0: 0, 1: 1, 2: 0})


def test_another_optimizer_class_is_refused() -> None:
    reports = [Report(0, {0: 1}, _layout("one", 1), ("momentum_buffer",), {}, (), "SGD")]
    with pytest.raises(UsageError, match="SGD state into AdamW"):
        plan_reshard(reports, _layout("one", 2), "AdamW")
    assert isinstance(plan_reshard(reports, _layout("one", 2), "SGD"), ReshardPlan)


def test_a_new_job_and_another_model_are_refused() -> None:
    assert isinstance(plan_reshard([Report(None, {}, None, (), None, None)], _layout("one", 1)), Fallback)
    other = ZeroLayout.of([[("z", (4,))]], 2)
    with pytest.raises(UsageError, match="different models"):
        plan_reshard(_reports(other, place_buddies([0, 1]), [0, 1]), _layout("one", 2))


class _Blocks(nn.Module):
    """GPT-shaped: an embedding, a ModuleList of blocks (stage 3's units) of uneven sizes, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6 + i)) for i in range(0, 3))
        self.head = nn.Linear(8, 11, bias=False)


def _stage_layout(stage: int, world: int) -> ZeroLayout:
    """The layout a ZeRO stage gives :class:`_Blocks` at ``world`` ranks: stages 1/2 buckets of at most 256 bytes
    (several, uneven, parameters straddling ranks), stage 3 one bucket per unit (the root, each block)."""
    model = _Blocks()
    named = list(model.named_parameters())
    key = lambda p: p.dtype  # noqa: E731
    groups = UnitPlan.of(model, None).groups(named, key) if stage == 3 else size_groups(named, key, bucket_bytes=256)
    return ZeroLayout(world, tuple(b.layout for b in layout_buckets(groups, world_size=world, rank=0)))


@pytest.mark.parametrize(("old_stage", "new_stage"), [(1, 1), (2, 2), (3, 3), (2, 3), (3, 1)])
@pytest.mark.parametrize(
    ("old_nodes", "survivors"), [([0, 1, 2], [0, 1]), ([0, 0, 1, 1], [2, 3]), ([0, 1], [0, 1, None])]
)
def test_the_stages_real_layouts(
    old_stage: int, new_stage: int, old_nodes: list[int], survivors: list[int | None]
) -> None:
    old, new = _stage_layout(old_stage, len(old_nodes)), _stage_layout(new_stage, len(survivors))
    reports = _reports(old, place_buddies(old_nodes), survivors)
    plan = plan_reshard(reports, new)
    assert isinstance(plan, ReshardPlan), plan
    _check_exactly_once(plan, old, new, reports)
