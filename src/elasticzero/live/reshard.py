"""In-memory reshard: a ZeRO state laid out for world N, held by the ranks of a new group (their own shards, their
buddies' copies), moved into an optimizer laid out for world M, over point-to-point transfers.

Three steps, the first and last thin I/O, the middle a pure decision over what they gathered:

1. *agree* (:func:`reshard_from`): every rank of the new group reports its :class:`Holdings` — which old ranks'
   states it holds at which step, its old rank (``None`` for a joining process), the old layout — in one object
   all-gather;
2. *decide* (:func:`plan_reshard`): the newest step every old rank's state is held at, a source rank for each, and
   the :class:`Transfer` s, or a :class:`Fallback` (some state has no copy left: both copies lost, or the survivors
   are at different steps) — errors as data, nothing touched;
3. *execute*: each rank sends what each peer needs (per peer and state key, one message per range that lies back to
   back in the old shard and in the new one: :func:`message_runs`), receives into the buffers of
   :meth:`~elasticzero.engine.zero.dcp_state.ZeroCheckpointState.load_template`, and installs them with
   ``load_state_dict`` — the very path a DCP load takes. A message is the state's own memory on both sides where it
   lies so there (a live optimizer's and a copy's state, a load template: one buffer per bucket), packed and unpacked
   otherwise; the local part is copied while the messages travel.

The chunk arithmetic is the DCP reshard's: what any rank owns of a parameter is
:meth:`~elasticzero.engine.zero.layout.ZeroLayout.pieces`, and which parts of the old pieces fill a new piece is
torch DCP's ``create_read_items_for_chunk_list`` (the resharding algorithm a checkpoint load runs), given the old
pieces as the "saved" chunks. The same plan serves every element-wise state tensor (masters, Adam's moments), whose
pieces coincide.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.comm.backends import wire_for
from elasticzero.engine.zero.comm.work import follows
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from elasticzero.engine.zero.layout import Piece, ZeroLayout
from elasticzero.engine.zero.sharded import ShardedState
from elasticzero.errors import UsageError


class Transfer(NamedTuple):
    """Elements ``[start, end)`` of flattened parameter ``name``, of old rank ``old_rank``'s state: from new rank
    ``src`` (at ``src_offset`` in old_rank's piece) to new rank ``dst`` (at ``dst_offset`` in its new piece)."""

    name: str
    old_rank: int
    src: int
    dst: int
    start: int
    end: int
    src_offset: int
    dst_offset: int


@dataclass(frozen=True)
class ReshardPlan:
    """Move the state at ``step``: old rank ``r``'s from new rank ``sources[r]``, by ``transfers``."""

    step: int
    sources: dict[int, int]
    transfers: tuple[Transfer, ...]

    def between(self, src: int, dst: int) -> list[Transfer]:
        """The transfers from ``src`` to ``dst``, in plan order (the order a packed message holds them)."""
        return [t for t in self.transfers if (t.src, t.dst) == (src, dst)]


@dataclass(frozen=True)
class Fallback:
    """No in-memory reshard: ``reason``; ``missing``: old ranks whose state no rank holds at a common step. Use the
    disk checkpoint. ``nothing_held``: no rank of the new group holds any state — a job's first round (build fresh or
    load the checkpoint), not a loss."""

    reason: str
    missing: tuple[int, ...] = ()
    nothing_held: bool = False


@dataclass(frozen=True)
class Holdings:
    """What one process brings to a reshard: its rank in the old group (``owner``; ``None`` when it joins), the states
    it holds by old rank, and the step each is at."""

    owner: int | None = None
    states: Mapping[int, ShardedState] = field(default_factory=dict)
    steps: Mapping[int, int] = field(default_factory=dict)

    def detached(self) -> Holdings:
        """These holdings detached from this process's model (:meth:`ShardedState.detached`): its own state's masters
        and every state's module entries (its own and its wards' copies all name the live module's frozen parameters
        and buffers: copied once) — for a survivor whose old optimizer hands the model back without a copy, to be
        wrapped again in place."""
        memo: dict[Hashable, torch.Tensor] = {}
        states = {r: st.detached(masters=r == self.owner, memo=memo) for r, st in self.states.items()}
        return replace(self, states=states)


@dataclass(frozen=True)
class Report:
    """One rank's part of the agreement (picklable: no tensors)."""

    owner: int | None
    steps: dict[int, int]
    layout: ZeroLayout | None
    keys: tuple[str, ...]
    scalars: dict[str, dict[str, Any]] | None
    param_groups: tuple[dict[str, Any], ...] | None
    optimizer: str = ""  # the wrapped optimizer's class name ("" when it holds nothing)


# -- decide (pure) ----------------------------------------------------------------------------------------------------
def choose_sources(reports: Sequence[Report], old_world: int) -> tuple[int, dict[int, int]] | Fallback:
    """The newest step at which every old rank's state is held, and who holds it (its owner when it survived, else
    the lowest new rank holding a copy); a :class:`Fallback` naming what is missing otherwise."""
    holders: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # step -> old -> new ranks
    for new, rep in enumerate(reports):
        for old, step in rep.steps.items():
            holders[step][old].append(new)
    for step in sorted(holders, reverse=True):
        if all(holders[step].get(old) for old in range(old_world)):
            owners = {rep.owner: new for new, rep in enumerate(reports) if rep.owner is not None}
            return step, {old: _prefer(owners.get(old), holders[step][old]) for old in range(old_world)}
    held_anywhere = {old for by_old in holders.values() for old in by_old}
    lost = tuple(old for old in range(old_world) if old not in held_anywhere)
    if lost:
        return Fallback(f"both copies of the state of old rank(s) {list(lost)} are lost", lost)
    return Fallback(
        "no step at which every old rank's state is held (survivors a step apart: a failure in the commit gate)", ()
    )


def _prefer(owner: int | None, holding: list[int]) -> int:
    """The owner when it holds the state (its own live shard: no copy is read), else the lowest rank holding it."""
    return owner if owner in holding else holding[0]


def plan_transfers(old: ZeroLayout, new: ZeroLayout, sources: Mapping[int, int]) -> tuple[Transfer, ...]:
    """Which elements of which old rank's pieces fill each new rank's pieces (DCP's resharding algorithm over the
    old pieces as saved chunks), every element of every parameter exactly once."""
    shapes = {n: x.shape for n, x in old.params.items()}
    if shapes != {n: x.shape for n, x in new.params.items()}:
        raise UsageError("in-memory reshard between different models: the old and new layouts' parameters differ")
    old_pieces = [old.pieces(r) for r in range(old.world_size)]
    new_pieces = [new.pieces(r) for r in range(new.world_size)]
    out: list[Transfer] = []
    for name, slot in new.params.items():
        saved = [(r, ps[name]) for r, ps in enumerate(old_pieces) if name in ps]
        md = TensorStorageMetadata(TensorProperties(), torch.Size([slot.numel]), [_box(p) for _, p in saved])
        for dst, ps in enumerate(new_pieces):
            if name not in ps:
                continue
            for item in create_read_items_for_chunk_list(name, md, [_box(ps[name])]):
                r, p = saved[item.storage_index.index or 0]  # DCP sets the index of the saved chunk it read
                a, n = p.start + item.storage_offsets[0], item.lengths[0]
                out.append(Transfer(name, r, sources[r], dst, a, a + n, item.storage_offsets[0], item.dest_offsets[0]))
    return tuple(out)


def _box(p: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([p.start]), sizes=torch.Size([p.end - p.start]))


def plan_reshard(reports: Sequence[Report], new: ZeroLayout, optimizer: str = "") -> ReshardPlan | Fallback:
    """The whole decision over every rank's :class:`Report` (equal on every rank, computed on every rank), for an
    optimizer laid out as ``new`` wrapping an ``optimizer`` (class name; its state keys must be the held ones')."""
    other = sorted({r.optimizer for r in reports if r.optimizer not in ("", optimizer)})
    if optimizer and other:
        raise UsageError(f"in-memory reshard of {other[0]} state into {optimizer}: wrap the same optimizer class")
    layouts = [r.layout for r in reports if r.layout is not None]
    if not layouts:
        return Fallback("no rank of the new group holds any state (a new job: load the checkpoint)", nothing_held=True)
    if any(x != layouts[0] for x in layouts):
        return Fallback("the survivors report different old layouts")
    chosen = choose_sources(reports, layouts[0].world_size)
    if isinstance(chosen, Fallback):
        return chosen
    step, sources = chosen
    return ReshardPlan(step, sources, plan_transfers(layouts[0], new, sources))


# -- agree and execute (thin I/O) ------------------------------------------------------------------------------------
def report_of(holdings: Holdings) -> Report:
    """This rank's :class:`Report`: the state's layout, element-wise keys and replicated values come from any state
    it holds (all of one old optimizer)."""
    any_state = next(iter(holdings.states.values()), None)
    if any_state is None:
        return Report(holdings.owner, dict(holdings.steps), None, (), None, None)
    keys = sorted({k for st in any_state.optim_state.values() for k in st})
    return Report(
        holdings.owner,
        dict(holdings.steps),
        any_state.layout,
        tuple(keys),
        any_state.scalars,
        any_state.param_groups,
        any_state.origin.optimizer,
    )


def reshard_from(opt: ZeroOptimizer, holdings: Holdings) -> ReshardPlan | Fallback:
    """Fill ``opt`` (built at the new world size, on the new group, every rank of it calling this) with the state the
    ranks of its group hold; collective. Returns the plan it ran, or the :class:`Fallback` (on every rank alike) when
    the state is not complete in memory — then ``opt`` is untouched: load the disk checkpoint.

    ``holdings``: what this process holds (:meth:`~elasticzero.live.copies.BuddyCopies.holdings`; a joining
    process passes ``Holdings()``). The held tensors must stay unchanged until this returns: build ``opt`` on a model
    built afresh, on the old one unwrapped with a copy (:meth:`ZeroOptimizer.unwrap`), or on the old one unwrapped
    without one and the holdings :meth:`~Holdings.detached` before — the held states of fp32 stages 1/2 view the old
    optimizer's buffers, which the old module's parameters view until then, and its own state's module entries are
    the old module's frozen parameters and buffers."""
    reports = opt.communicator.all_gather_object(report_of(holdings), tag="reshard")
    plan = plan_reshard(reports, opt.layout, opt.origin.optimizer)
    if isinstance(plan, Fallback):
        return plan
    src_report = reports[plan.sources[0]]
    keys = src_report.keys
    state = ZeroCheckpointState(opt)
    template = state.load_template()
    wire = wire_for(opt.communicator.backend, opt.device)  # the device every message travels on
    assert src_report.layout is not None  # a plan has a source, which holds state
    _fill(opt, plan, holdings.states, template, keys, wire, src_report.layout)
    _fill_replicated(opt, plan.sources[0], template, src_report, holdings.states.get(0), wire)
    state.load_state_dict(template)
    return plan


def served_by(plan: ReshardPlan, dst: int, src: int) -> bool:
    """Whether every element new rank ``dst`` received in ``plan`` came from new rank ``src`` (``src`` sent ``dst``
    its whole state: a joiner's from the one survivor that held it). Pure: every rank decides alike."""
    return all(t.src == src for t in plan.transfers if t.dst == dst)


@dataclass(frozen=True)
class Seed:
    """What a rank keeps of a round's reshard, for its wards' first copies (:class:`~elasticzero.live.copies.
    BuddyCopies`, ``seed=``): the ``plan`` it ran and the states it ``held`` (by old rank; unchanged since). A ward
    whose whole state this rank sent it (:func:`served_by`) has its copy made here from the same elements, not
    mirrored back: bitwise what the ward holds, without its bytes crossing the wire a second time."""

    plan: ReshardPlan
    held: Mapping[int, ShardedState]

    def serves(self, ward: int, holder: int) -> bool:
        """Whether ``holder`` sent ``ward`` its whole state in the reshard (and makes its copy from the seed)."""
        return served_by(self.plan, ward, holder)

    def fill(self, ward: int, layout: ZeroLayout, key: str, boxes: Mapping[int, torch.Tensor]) -> None:
        """Write the elements ``ward`` received of state ``key`` (``"params"``: the master) into ``boxes`` (by bucket
        of ``layout``, the new layout: 1-D, laid out as ``ward``'s shard of that bucket), the rest of each (its
        padding) zeroed. Only for a ward this rank :meth:`serves`."""
        trees = {r: st.state_dict() for r, st in self.held.items()}
        pieces = layout.pieces(ward)
        for index, box in boxes.items():
            lo, hi = layout.buckets[index].shard_range(ward)
            box[max(0, min(hi, layout.buckets[index].numel) - lo) :].zero_()
        for t in self.plan.transfers:
            into = boxes.get(layout.params[t.name].bucket)
            if t.dst == ward and into is not None:
                at = pieces[t.name].shard_offset + t.dst_offset
                into[at : at + t.end - t.start].copy_(source_of(trees, t, key))


def source_of(trees: Mapping[int, Mapping[str, Any]], t: Transfer, key: str) -> torch.Tensor:
    """The elements transfer ``t`` moves of state ``key``, in the held states' trees (by old rank)."""
    return _slice(_chunk(trees[t.old_rank], t.name, key), t.src_offset, t)


def _dest_of(template: Mapping[str, Any], t: Transfer, key: str) -> torch.Tensor:
    """Where transfer ``t``'s elements of state ``key`` go in the new rank's ``template``."""
    return _slice(_chunk(template, t.name, key), t.dst_offset, t)


def _chunk(tree: Mapping[str, Any], name: str, key: str) -> torch.Tensor:
    """The tensor of ``name``'s piece for state ``key`` (``"params"``: the master) in a state dict of
    :class:`ShardedState`'s shape."""
    chunk = tree["params"][name] if key == "params" else tree["optim"]["state"][name][key]
    return chunk.tensor


def _fill(
    opt: ZeroOptimizer,
    plan: ReshardPlan,
    held: Mapping[int, ShardedState],
    template: Mapping[str, Any],
    keys: Sequence[str],
    wire: torch.device,
    old: ZeroLayout,
) -> None:
    """Run this rank's transfers into ``template``: the messages of :func:`message_runs` (every rank posts them in the
    same order: keys, peer pairs, runs), on the wire (:func:`~elasticzero.engine.zero.comm.backends.wire_for`) —
    each the held state's or the template's own memory where it lies back to back there, else packed and unpacked —
    and, while they travel, the local transfers as copies (a rank's local and received pieces are disjoint)."""
    me, sends, recvs, unpacks, local = opt.rank, [], [], [], []
    trees = {r: st.state_dict() for r, st in held.items()}
    peers = sorted({(t.src, t.dst) for t in plan.transfers if me in (t.src, t.dst)})
    for key in ("params", *keys):
        for src, dst in peers:
            ts = plan.between(src, dst)
            if src == dst:
                local.append((ts, key))
                continue
            for run in message_runs(ts, old, opt.layout):
                if src == me:
                    sends.append((_outgoing(trees, run, key, wire), dst))
                    continue
                into = _joined([_dest_of(template, t, key) for t in run], wire)
                if into is None:
                    into = torch.empty(_length(run), dtype=_chunk(template, run[0].name, key).dtype, device=wire)
                    unpacks.append((into, run, key))
                recvs.append((into, src))
    work = opt.communicator.exchange(sends, recvs, tag="reshard", async_op=True)
    for ts, key in local:
        _copy_local(template, trees, ts, key)
    if work is not None:
        work.wait()
        opt.communicator.settle()
    for buf, ts, key in unpacks:
        _unpack(template, buf, ts, key)


def message_runs(ts: Sequence[Transfer], old: ZeroLayout, new: ZeroLayout) -> list[list[Transfer]]:
    """The messages the transfers ``ts`` between one pair of ranks travel in (in order): consecutive transfers share
    one while each continues the one before in the old rank's bucket shard (layout ``old``) and in the new rank's
    (``new``) — ranges that lie back to back in any state laid out one buffer per bucket, so neither side copies them
    (:func:`_joined`). Pure, over the layouts alone: both sides split alike, whatever their memory."""
    olds = {r: old.pieces(r) for r in {t.old_rank for t in ts}}
    news = {d: new.pieces(d) for d in {t.dst for t in ts}}
    out: list[list[Transfer]] = []
    for t in ts:
        if out and _continues(out[-1][-1], t, old, new, olds, news):
            out[-1].append(t)
        else:
            out.append([t])
    return out


def _continues(
    a: Transfer,
    b: Transfer,
    old: ZeroLayout,
    new: ZeroLayout,
    olds: Mapping[int, Mapping[str, Piece]],
    news: Mapping[int, Mapping[str, Piece]],
) -> bool:
    """Whether transfer ``b`` starts where ``a`` ends in the same old rank's bucket shard and the same new one's."""
    n = a.end - a.start
    if (a.old_rank, a.dst) != (b.old_rank, b.dst):
        return False
    if (old.params[a.name].bucket, new.params[a.name].bucket) != (old.params[b.name].bucket, new.params[b.name].bucket):
        return False
    at_old = olds[b.old_rank][b.name].shard_offset + b.src_offset
    at_new = news[b.dst][b.name].shard_offset + b.dst_offset
    return at_old == olds[a.old_rank][a.name].shard_offset + a.src_offset + n and at_new == (
        news[a.dst][a.name].shard_offset + a.dst_offset + n
    )


def _joined(parts: Sequence[torch.Tensor], wire: torch.device) -> torch.Tensor | None:
    """One 1-D tensor viewing ``parts`` (1-D tensors, in order) where they lie back to back in one storage on the
    ``wire``; None where they do not (they are packed then)."""
    first = parts[0]
    if first.device != wire or first.stride() != (1,) or not all(itertools.starmap(follows, itertools.pairwise(parts))):
        return None
    return first.as_strided((sum(p.numel() for p in parts),), (1,))


def _outgoing(
    trees: Mapping[int, Mapping[str, Any]], ts: Sequence[Transfer], key: str, wire: torch.device
) -> torch.Tensor:
    """What a message of transfers ``ts`` sends: the held state's own memory where the elements lie back to back
    there (:func:`_joined`), else :func:`_pack`."""
    joined = _joined([source_of(trees, t, key) for t in ts], wire)
    return joined if joined is not None else _pack(trees, ts, key, wire)


def _pack(trees: Mapping[int, Mapping[str, Any]], ts: Sequence[Transfer], key: str, wire: torch.device) -> torch.Tensor:
    """The elements of transfers ``ts`` of state ``key``, from the held states' trees (this rank's own state on its
    device, its wards' copies on the host), back to back in one buffer on the ``wire``."""
    parts = [source_of(trees, t, key) for t in ts]
    out = torch.empty(_length(ts), dtype=parts[0].dtype, device=wire)
    at = 0
    for part in parts:
        out[at : at + part.numel()].copy_(part)
        at += part.numel()
    return out


def _length(ts: Sequence[Transfer]) -> int:
    """Elements of transfers ``ts`` back to back (a packed message's length)."""
    return sum(t.end - t.start for t in ts)


def _copy_local(
    template: Mapping[str, Any], trees: Mapping[int, Mapping[str, Any]], ts: Sequence[Transfer], key: str
) -> None:
    """Transfers ``ts`` of state ``key`` within this rank: straight from the held states into ``template``."""
    for t in ts:
        _dest_of(template, t, key).copy_(source_of(trees, t, key))


def _unpack(template: Mapping[str, Any], buf: torch.Tensor, ts: Sequence[Transfer], key: str) -> None:
    """Copy a packed ``buf`` (transfers ``ts`` of state ``key``, back to back) into the new pieces of ``template``."""
    at = 0
    for t in ts:
        _dest_of(template, t, key).copy_(buf[at : at + t.end - t.start])
        at += t.end - t.start


def _slice(t: torch.Tensor, offset: int, tr: Transfer) -> torch.Tensor:
    return t[offset : offset + tr.end - tr.start]


def _fill_replicated(
    opt: ZeroOptimizer,
    src: int,
    template: dict[str, Any],
    report: Report,
    old_rank0: ShardedState | None,
    wire: torch.device,
) -> None:
    """The values every rank holds alike: scalars and hyper-parameters (from the agreement), the frozen parameters
    and buffers (the old module's, broadcast on the ``wire`` from ``src``, which holds old rank 0's state
    ``old_rank0``); optimizer state keys the old state did not have (it never stepped) are left out, so the load makes
    them fresh."""
    assert report.scalars is not None and report.param_groups is not None
    template["optim"]["scalars"] = {k: [[n, v] for n, v in by.items()] for k, by in report.scalars.items()}
    template["optim"]["param_groups"] = {str(i): dict(g) for i, g in enumerate(report.param_groups)}
    for name, st in template["optim"]["state"].items():
        template["optim"]["state"][name] = {k: v for k, v in st.items() if k in report.keys}
    for k, t in template["module"].items():
        buf = t if t.device == wire else torch.empty_like(t, device=wire)  # the broadcast on the wire
        if opt.rank == src:
            assert old_rank0 is not None  # the plan's source of old rank 0 holds its state
            buf.copy_(old_rank0.module[k])
        opt.communicator.broadcast(buf, src, tag="reshard")
        if buf is not t:
            t.copy_(buf)
