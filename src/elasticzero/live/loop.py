"""The loop construct: one ``with`` per step in the user's loop; a step left for a new round is redone there.

::

    live = LiveTraining.from_agent(build, sampler=sampler)   # under elasticzero-run's live mode: the round file
    for attempt in live.steps(total):
        with attempt:                                   # the one construct
            for idx in attempt.micro_batches:           # this rank's sample indices, micro-batch by micro-batch
                loss_of(attempt.model, data[idx]).backward()
            attempt.opt.step()
            attempt.opt.zero_grad()
        if attempt.committed:                           # the with swallowed a round change: count only commits
            log_and_checkpoint(live.step)

``build(group)`` makes the model and its ZeRO optimizer on a process group (called once per round); ``rebuild(group,
module)``, where given, makes them on a survivor's own model instead: unwrapped from its old optimizer without a copy,
its parameters still lying flat in that optimizer's buffers, which the new optimizer takes over in place (stages 1/2
at fp32); what the reshard reads of them — the master shard, the module's buffers — is copied aside first
(:meth:`Holdings.detached`), and the reshard then writes the new shard's state into them. Every round — the first
one too — is entered the same way, by survivors and fresh processes alike (:meth:`LiveTraining._enter`):

1. the round's group is formed: a fresh default group on the round's store and prefix (:mod:`.group`; the previous
   one, if any, is left and kept referenced);
2. ``build(group)`` (a survivor whose optimizer allows it: ``rebuild(group, module)``) at the round's world, its
   communicator bounded by a watch of the round file;
   :func:`~elasticzero.live.reshard.reshard_from` fills it from what the members hold (a survivor: its own
   state and its wards' copies, :meth:`BuddyCopies.holdings`; a fresh process: nothing);
3. the group decides where training goes on (:func:`resume_point`, pure over the plan and the members' sampler
   positions, all-gathered): nobody holds state → the job's first round (the state as built, or the caller's
   ``resume``: a disk checkpoint); else the reshard's step, the sampler position and the world-independent engine
   state (what ``build``'s result lists in ``carried()``: the LR schedule, the loss scale) from the holder of old
   rank 0's state (a fresh process learns all of it from its peers); some state lost → :class:`ReshardFallback` (the
   restart path);
4. a survivor whose step in flight had passed its commit gate everywhere counts it done (the reshard is one step
   ahead; its attempt reports it committed, once), and every member counts that step in the carried engine state
   (``count_taken_step()``: the schedule and the scale at exactly the resumed step); the sampler is re-cut at the new
   rank and world (the global batch is kept);
5. a new :class:`BuddyCopies` for the new world.

All of it is one :class:`RoundState`, built whole and assigned once: an entry a newer round interrupts is thrown away
with everything it built, and starts over with that round from the same holdings.

The attempt's ``with`` leaves on :class:`~elasticzero.live.bounded.Reconfigure` (any wait of the step's collectives
left for a newer round) and enters the new round in the same process. No committed step is redone. Errors are
classified once (:func:`peer_failure`): a lost peer's waits for the agent's round, the step's own (a ``ValueError``
in the loss, an out-of-memory) is raised at once. :meth:`LiveTraining.bounded` is the one verb for other collectives
of the round's group. A plain run (no round file) is one :class:`StaticTraining` round with the same attempts; the
training object of both is :class:`elasticzero.live.Training` (:mod:`.training`).
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import re
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from elasticzero.data.sampler import ElasticSampler
from elasticzero.device import Facts, Placement, placement
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.comm.communicator import Communicator
from elasticzero.errors import UsageError
from elasticzero.live.bounded import BoundedWait, LiveError, Reconfigure, Unbounded
from elasticzero.live.copies import BuddyCopies
from elasticzero.live.group import RoundGroups, RoundWatch, aborts_on_announce, group_spec
from elasticzero.live.reshard import Fallback, Holdings, ReshardPlan, Seed, reshard_from
from elasticzero.progress import reporter
from elasticzero.rounds import (
    AT_ONCE,
    NEW_MEMBER,
    ROUND_FILE_ENV,
    NodeRound,
    RoundError,
    RoundFile,
    ready_value,
    state_follows,
    switch_decision,
    switch_proposal,
    switches,
)


class ReshardFallback(LiveError):
    """Both copies of some state are lost (or the survivors are a step apart): load the disk checkpoint."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(f"in-memory reshard impossible: {fallback.reason}; restart from the disk checkpoint")
        self.fallback = fallback


@dataclass(frozen=True)
class RoundEvent:
    """One reconfiguration: the round, when this process left the old group, when the new state was in place, the
    step it resumed at, and when the first step at the new world completed (``None`` until it did)."""

    round: NodeRound
    left_at: float
    ready_at: float
    step: int
    first_step_at: float | None = None


@dataclass(frozen=True)
class ResumeAt:
    """Where a round's training goes on: ``step``, and the sampler ``position`` (a state dict) and the world-independent
    engine state ``carried`` (state dicts by name, :func:`held_state`) ``behind`` steps before it (the source's step in
    flight counted done by the reshard)."""

    step: int
    position: dict[str, Any]
    behind: int
    carried: Mapping[str, Any] = field(default_factory=dict)


#: one member's position for the agreement: (its step, its sampler's state dict, its world-independent engine state,
#: :func:`held_state`); None for a fresh process
Position = tuple[int, dict[str, Any], dict[str, Any]] | None


def resume_point(plan: ReshardPlan | Fallback, positions: Sequence[Position]) -> ResumeAt | None:
    """The group's decision (the same on every member): ``None`` when nobody holds state (the job's first round), the
    reshard's step with the source's sampler position and engine state otherwise; :class:`ReshardFallback` when some
    state is lost, a :class:`LiveError` when the source's position does not lead to the reshard's step."""
    if isinstance(plan, Fallback):
        if plan.nothing_held:
            return None
        raise ReshardFallback(plan)
    src = positions[plan.sources[0]]  # the holder of old rank 0's state: a member that held state
    if src is None or not 0 <= plan.step - src[0] <= 1:
        raise LiveError(f"the in-memory reshard is at step {plan.step}, its source's sampler at {src and src[0]}")
    return ResumeAt(plan.step, src[1], plan.step - src[0], src[2])


def held_state(built: Any) -> dict[str, Any]:
    """The world-independent engine state of what ``build`` returned: the state dicts of its ``carried()`` pieces
    (:meth:`EnginePieces.carried <elasticzero.config.build.EnginePieces.carried>`); empty when it has none."""
    pieces = built.carried() if hasattr(built, "carried") else {}
    return {name: piece.state_dict() for name, piece in pieces.items()}


def carry(built: Any, at: ResumeAt) -> None:
    """Load ``at``'s engine state into ``built``'s ``carried()`` pieces (after the reshard: the schedule's load sets the
    optimizer's learning rates), then count the ``behind`` steps the reshard counted done in it
    (``count_taken_step()``), so the schedule and the scale are at exactly ``at.step``."""
    pieces = built.carried() if hasattr(built, "carried") else {}
    if pieces.keys() != at.carried.keys():
        raise LiveError(f"this process's engine state is {sorted(pieces)}, its peers' {sorted(at.carried)}: every "
                        "process must build from the same config")  # fmt: skip
    for name, piece in pieces.items():
        piece.load_state_dict(dict(at.carried[name]))
    for _ in range(at.behind if pieces else 0):
        built.count_taken_step()


def recut(template: ElasticSampler, position: Mapping[str, Any], behind: int, rank: int, world: int) -> ElasticSampler:
    """``template``'s sampler at another rank and world size, at ``position`` moved ``behind`` global batches on."""
    new = ElasticSampler(
        template.num_samples,
        global_batch_size=template.global_batch_size,
        micro_batch_size=template.micro_batch_size,
        rank=rank,
        world_size=world,
        seed=template.seed,
        shuffle=template.shuffle,
    )
    new.load_state_dict(dict(position))
    new.advance(behind * new.accumulation_steps)
    return new


def local_rank_of(env: Mapping[str, str]) -> int:
    """``LOCAL_RANK`` (0 when unset); not a number: :class:`UsageError`."""
    raw = env.get("LOCAL_RANK", "0")
    if not (raw.isascii() and raw.isdigit()):
        raise UsageError(f"LOCAL_RANK={raw!r} is not a local rank; start workers with elasticzero-run")
    return int(raw)


def first_round(env: Mapping[str, str]) -> tuple[RoundFile, NodeRound]:
    """The round file named by ``$ELASTICZERO_ROUND_FILE`` and the round in it; :class:`UsageError` when there is
    none or it is not a round."""
    path = env.get(ROUND_FILE_ENV)
    if not path:
        raise UsageError(
            f"{ROUND_FILE_ENV} is not set: LiveTraining.from_agent runs under elasticzero-run in live mode"
        )
    rounds = RoundFile(path)
    found = rounds.poll(-1)
    if found is None:
        raise UsageError(f"{path} ({ROUND_FILE_ENV}): no round file; the agent writes it before starting the workers")
    if isinstance(found, RoundError):
        raise UsageError(found.reason)
    return rounds, found


def optimizer_of(built: Any) -> Any:
    """The optimizer of what ``build(group)`` returned: the optimizer itself, or an object's ``optimizer``."""
    return built if isinstance(built, torch.optim.Optimizer) else built.optimizer


def peer_failure(err: BaseException) -> bool:
    """Whether ``err``, raised in a live step, may be a lost peer's (the agent's round is then expected): a torch
    ``DistError``, or a ``RuntimeError`` raised where collectives are issued (a frame in ``torch.distributed`` or in
    elasticzero's engine or live loop: gloo fails a collective posted on a closed pair when it is issued). Anything
    else is the step's own error — a ``ValueError`` in the loss, a CUDA out-of-memory — and is raised at once."""
    if isinstance(err, LiveError | torch.OutOfMemoryError) or not isinstance(err, RuntimeError):
        return False
    if isinstance(err, dist.DistError):
        return True
    return any(_COLLECTIVE_FRAME.search(f.filename) for f in traceback.extract_tb(err.__traceback__))


_COLLECTIVE_FRAME = re.compile(r"[\\/](torch[\\/]distributed|elasticzero[\\/](engine|live))[\\/]")


@dataclass
class RoundState:
    """One round as this process entered it, built whole and assigned once (an entry a newer round interrupted is
    thrown away with everything it built): the round (``None``: the static round of a plain run), its bound, the NCCL
    watch, what ``build`` returned and its optimizer, the copies, the re-cut sampler and the step. Only ``step`` (and
    the sampler's position) move afterwards: at each commit."""

    round: NodeRound | None
    bound: Any  # BoundedWait, or Unbounded in a static round
    watch: RoundWatch | None
    built: Any
    opt: Any
    copies: BuddyCopies | None
    sampler: ElasticSampler
    step: int
    #: the entry's seconds per phase (``group``, ``build``, ``reshard``, ``agree``, ``copies``): its cost split
    entry: dict[str, float] = field(default_factory=dict)


class _Rounds:
    """What both kinds of training share: the round in force (:class:`RoundState`), the record, the steps, the
    bounded verb and the commit."""

    now: RoundState

    def __init__(self) -> None:
        self.record: list[tuple[int, list[int]]] = []  # (step, this rank's samples) of every committed step
        self.events: list[RoundEvent] = []
        self.in_attempt = False  # inside an attempt's ``with`` (a step)
        self.entering = False  # in an attempt's check before its step (Attempt.__enter__)
        #: the step the job ends at (``steps``' total, or the constructor's): a join is never deferred past its last
        self.end: int | None = None

    @property
    def step(self) -> int:
        return self.now.step

    @property
    def sampler(self) -> ElasticSampler:
        return self.now.sampler

    @property
    def opt(self) -> Any:
        return self.now.opt

    @property
    def built(self) -> Any:
        return self.now.built

    @property
    def bound(self) -> Any:
        return self.now.bound

    @property
    def copies(self) -> BuddyCopies | None:
        return self.now.copies

    @property
    def round(self) -> NodeRound | None:
        return self.now.round

    @property
    def rank(self) -> int:
        return int(self.opt.rank) if hasattr(self.opt, "rank") else dist.get_rank()

    @property
    def model(self) -> Any:
        return self.opt.module

    @property
    def micro_batches(self) -> list[list[int]]:
        """This rank's sample indices of the step in flight, one list per micro-batch."""
        return micro_batches_of(self.sampler)

    def steps(self, total: int) -> Iterator[Attempt]:
        """Attempts until ``total`` steps are committed (a step left for a new round is attempted again); ``total`` is
        the job's end (:attr:`end`)."""
        self.end = total
        while self.step < total:
            yield Attempt(self)

    def bounded(self, work: Callable[[], None]) -> bool:
        """Run ``work`` — collectives of the round's group outside the engine (a checkpoint save, an evaluation) —
        bounded like the engine's waits. True once it completed in this round. When a newer round was announced (or
        a peer's loss failed it and the agent's round came) meanwhile: inside an attempt the attempt is left
        (:class:`Reconfigure`, its ``with`` enters the round and the step is attempted again there); outside one the
        round is entered here and False returned — decide again there, over the new round's state, whether to redo
        ``work``. The thread running an abandoned ``work`` stays in it (a save left so is fenced out of its directory
        by the new round's checkpointer). In a static round (a plain run) ``work`` just runs."""
        if self.in_attempt:
            self.bound.check()  # a round announced before the work: leave now, not after it
            self.bound(work)
            return True
        try:
            self.bound.check()
            self.bound(work)
            return True
        except Reconfigure as leave:
            round_ = leave.round
        except RuntimeError as err:  # issued on a group a lost peer's sockets closed: the agent's round is expected
            round_ = self._round_after(err, self.bound)
        self.reconfigure(round_)
        return False

    def commit(self) -> None:
        """The step in flight completed: record its samples, move the sampler one global batch on."""
        now = self.now
        self.record.append((now.step, [i for mb in micro_batches_of(now.sampler) for i in mb]))
        now.sampler.advance(now.sampler.accumulation_steps)
        now.step += 1
        if self.events and self.events[-1].first_step_at is None:
            self.events[-1] = _first_step(self.events[-1], time.monotonic())
            self._after_first_step()

    def _after_first_step(self) -> None:
        """After the first step of a round entered in this process (a live round change): nothing here."""

    def reconfigure(self, round_: NodeRound) -> None:
        raise LiveError(f"round {round_.number} announced to a static round")  # pragma: no cover - live only

    def _round_after(self, err: RuntimeError, bound: Any) -> NodeRound:
        if not peer_failure(err):
            raise err
        try:
            bound.after_failure(err)
        except Reconfigure as leave:
            return leave.round
        raise err  # after_failure raises; for the type checker

    def close(self) -> None:
        """Stop the copies and the bound's thread."""
        if self.copies is not None:
            self.copies.close()
        self.bound.close()
        if self.now.watch is not None:
            self.now.watch.close()


def micro_batches_of(s: ElasticSampler) -> list[list[int]]:
    """``s``'s rank's sample indices of the global batch at its position, one list per micro-batch."""
    return [s.micro_batch(s.epoch, p) for p in range(s.consumed, s.consumed + s.global_batch_size, s.micro_step)]


#: the job's start sampler: the sampler itself, or made from the first round's ``build`` result
SamplerSource = ElasticSampler | Callable[[Any], ElasticSampler]


def template_of(source: SamplerSource, built: Any) -> ElasticSampler:
    return source if isinstance(source, ElasticSampler) else source(built)


class StaticTraining(_Rounds):
    """A plain run's one round: the default group (``group``) as the launcher formed it, ``build(group)`` once, the
    job's start from ``resume`` (the disk checkpoint), no copies and no watch — a failure is the restart path's."""

    def __init__(
        self,
        build: Callable[[Any], Any],
        *,
        sampler: SamplerSource,
        group: Any,
        resume: Callable[[Any, ElasticSampler], int] | None = None,
        start_step: int = 0,
    ) -> None:
        super().__init__()
        built = build(group)
        template = template_of(sampler, built)
        step = resume(built, template) if resume is not None else start_step
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        recut_ = recut(template, template.state_dict(), 0, rank, world)
        self.now = RoundState(None, Unbounded(), None, built, optimizer_of(built), None, recut_, step)

    @property
    def rank(self) -> int:
        return dist.get_rank()


class LiveTraining(_Rounds):
    """A ZeRO training job that survives membership changes in its processes (see the module).

    Build it with :meth:`from_agent` under the agent; the constructor takes the pieces explicitly.

    Args:
        build: ``build(group)``: a fresh model and its ZeRO optimizer on ``group`` — the optimizer, or an object
            whose ``optimizer`` it is (called once per round entered; its ``copies_config``, when it has one, a config's
            ``zero.copies``, set the copies instead of the four options below; its ``carried()``, when it has one,
            the world-independent pieces a round change carries from a peer — with ``count_taken_step()``, a step the
            reshard counted done — as :class:`~elasticzero.config.build.EnginePieces` has them). It runs bounded, on
            the bound's helper thread (:meth:`BoundedWait.call`): torch's per-thread settings of the caller (a default
            device, grad mode) do not reach it; the CUDA device is set there. Where ``build`` (and ``rebuild``) take
            a keyword ``sync_module_states``, it is False in a round some member holds state in (the ready keys say:
            :func:`~elasticzero.rounds.state_follows`): the reshard writes every model's state, so the optimizer's
            broadcast of the module from rank 0 (``ZeroOptions.sync_module_states``) can be left out.
        sampler: the job's :class:`ElasticSampler` at its start position, or ``sampler(built)`` making it from the
            first ``build`` result (the loop re-cuts it for each round's rank and world, and moves it; never iterate
            it). A process joining a running job takes the position from its peers; the settings (samples, global
            batch, micro batch, seed) must be the job's.
        rounds: the :class:`RoundFile` the waits poll; ``first``: the round this process starts in.
        local_rank: this process's local rank (its entry in the round's ranks).
        where: the device and backend (:func:`elasticzero.device.placement`); default: CPU over gloo.
        nodes: ``nodes(world_size)``, the node of every rank of a round (the buddy placement); default: gathered.
        poll_s, failure_grace_s: the bound of the waits (:class:`BoundedWait`).
        group_timeout: the collective timeout of the groups it forms (default: the placement's, the launcher's).
        resume: the job's first round only (nobody holds state): ``resume(built, sampler) -> step`` loads the disk
            checkpoint into what ``build`` returned and the job's sampler, and returns its step; default: the state as
            built, at ``start_step``.
        start_step: the step a fresh job starts at without ``resume``.
        rebuild: ``rebuild(group, module)``: what ``build`` returns, made on ``module`` — this process's model of the
            round it leaves, unwrapped from its optimizer without a copy (:meth:`ZeroOptimizer.unwrap`), its
            parameters lying flat in that optimizer's buffers, which a stage-1/2 wrap takes over — instead of a fresh
            model: a survivor keeps its model and buffers across a round change (the reshard overwrites them). Used
            where the old optimizer allows it (:meth:`ZeroOptimizer.rewrappable`: stages 1/2 at fp32 parameters);
            else, and without ``rebuild``, ``build`` makes the round afresh.
        prepare: ``prepare()``, run once before the first round's group is formed (after :func:`warm_up`): what a
            process can make before it has a group — its model (:class:`~elasticzero.live.training.Training`'s
            ``make_model``). A joining process says it is ready to its running peers when that formation starts;
            until then they train on at the old world, so what runs here costs them nothing.
        replicate, node_shift, overlap, early: the buddy copies (:class:`BuddyCopies`'s ``enabled``, ``node_shift``,
            ``overlap``, ``early``; a config's ``zero.copies``): without copies a lost node's state is lost, and its
            loss falls back to the disk checkpoint (``ReshardFallback``).
        end: the step the job ends at (:meth:`steps` sets it to its ``total``): a join is switched to before it
            (:func:`~elasticzero.rounds.switch_proposal`).
    """

    def __init__(
        self,
        build: Callable[[Any], Any],
        *,
        sampler: SamplerSource,
        rounds: RoundFile,
        first: NodeRound,
        local_rank: int = 0,
        where: Placement | None = None,
        nodes: Callable[[int], Sequence[Hashable]] | None = None,
        poll_s: float = 0.05,
        failure_grace_s: float = 30.0,
        group_timeout: timedelta | None = None,
        resume: Callable[[Any, ElasticSampler], int] | None = None,
        start_step: int = 0,
        rebuild: Callable[[Any, Any], Any] | None = None,
        prepare: Callable[[], None] | None = None,
        replicate: bool = True,
        node_shift: int = 1,
        overlap: bool = True,
        early: bool = True,
        end: int | None = None,
    ) -> None:
        super().__init__()
        self.end = end
        self._switch: tuple[int, int] | None = None  # (round, decision): the members' switch decision for a round
        self._leaving = False  # left the round it trained in, entering another (its ready value says so)
        self.build, self.rebuild, self.rounds, self.nodes, self.resume = build, rebuild, rounds, nodes, resume
        self.replicate, self.node_shift, self.overlap, self.early = replicate, node_shift, overlap, early  # copies
        self.local_rank, self.where = local_rank, where or Placement("cpu", "gloo", alone=False)
        self.poll_s, self.failure_grace_s, self.group_timeout = poll_s, failure_grace_s, group_timeout
        self.groups = RoundGroups()  # every round's group, the abandoned ones kept
        warm_up()  # before this process says it is ready (its first group's formation): a joiner's peers train on
        if prepare is not None:
            prepare()
        self._enter_until_settled(first, Holdings(), Start(start_step, sampler), None, NEW_MEMBER)

    @classmethod
    def from_agent(
        cls,
        build: Callable[[Any], Any],
        *,
        sampler: SamplerSource,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> LiveTraining:
        """The job as the agent starts it: the round file at ``$ELASTICZERO_ROUND_FILE``, ``LOCAL_RANK``, the device
        rule of :mod:`elasticzero.device` (``cuda:$LOCAL_RANK`` over NCCL with CUDA, else the CPU over gloo) and the
        launcher's collective timeout; the first round's group is formed here (do not call ``init_process_group``
        or ``init_distributed`` first). A process joining a running job takes its state from its peers. ``env``:
        the environment to read (default ``os.environ``); ``options``: the constructor's."""
        env = os.environ if env is None else env
        if dist.is_initialized():
            raise UsageError("LiveTraining.from_agent forms each round's process group itself: drop init_process_group")
        rounds, first = first_round(env)
        where = placement(Facts.current(env))
        if where.bound_device is not None:
            torch.cuda.set_device(torch.device(where.bound_device))
        return cls(
            build, sampler=sampler, rounds=rounds, first=first, local_rank=local_rank_of(env), where=where, **options
        )

    @property
    def watch(self) -> RoundWatch | None:
        return self.now.watch

    def _after_first_step(self) -> None:
        """The groups of the rounds left, cut when this one settled, let go (:meth:`RoundGroups.let_go`): off the
        round change's path, their destructors hold the interpreter's lock for tens of milliseconds."""
        self.groups.let_go()

    def reconfigure(self, round_: NodeRound) -> None:
        """Leave the old round for ``round_`` in this process (see the module)."""
        left_at = time.monotonic()
        now = self.now
        start = Start(now.step, now.sampler, held_state(now.built))
        holdings = now.copies.holdings() if now.copies else Holdings()
        if self._keeps_buffers(now):  # the next wrap writes what its held state views: copied aside (once, every try)
            holdings = holdings.detached()
        ready = self._ready_value()  # what it said for round_ while it trained in its round
        self._leaving = True
        entered = self._enter_until_settled(round_, holdings, start, now, ready)
        self.events.append(RoundEvent(entered, left_at, time.monotonic(), self.step))

    def _enter_until_settled(
        self, round_: NodeRound, holdings: Holdings, start: Start, old: RoundState | None, ready: str
    ) -> NodeRound:
        """:meth:`_enter` ``round_``; a newer round in the file meanwhile (a second change) starts over with it, from
        the same holdings and the same start (everything the interrupted entry built is thrown away). The entered
        round's value is assigned once; a step in flight its reshard counted done is committed then, once. Returns
        the round entered."""
        previous = old
        while True:
            bound = self._bound(round_)  # a failure from here on waits for a round newer than this one
            try:
                value, caught_up = self._enter(round_, bound, holdings, start, old, ready)
                break
            except Reconfigure as again:
                round_ = again.round
            except RuntimeError as err:  # a member lost meanwhile: its sockets closed, the agent's round is expected
                round_ = self._round_after(err, bound)
            old, ready = None, self._ready_value()  # the old group was left by the interrupted entry
        if caught_up:
            self._commit_in_flight(start)
        self.now, self._leaving = value, False
        if previous is not None:
            release(previous)  # its holdings are in the new round's state now
        self.groups.cut_left()  # every member formed this round's group: the old groups' pending work fails, freed
        return round_

    def _commit_in_flight(self, start: Start) -> None:
        """Record the step in flight at ``start`` (the reshard counted it done: its gate passed everywhere)."""
        sampler = start.sampler
        assert isinstance(sampler, ElasticSampler)
        self.record.append((start.step, [i for mb in micro_batches_of(sampler) for i in mb]))

    def _enter(
        self,
        round_: NodeRound,
        bound: BoundedWait,
        holdings: Holdings,
        start: Start,
        old: RoundState | None,
        ready: str,
    ) -> tuple[RoundState, bool]:
        """Form ``round_``'s group (``ready``: this process's ready value for it), build at its world, fill it,
        position the sampler (the module's steps 1-5); the same code for a survivor (``holdings`` its own) and a
        fresh process (``Holdings()``). Returns the round's value and whether the step in flight was counted done."""
        reporter().entered_round(round_.number)  # the hang watch: no step in this round yet; no failed collective
        aborted = False
        if old is not None and old.watch is not None:
            old.watch.close()
            aborted = old.watch.fired  # NCCL: the watch aborted the old group (final now)
            self._drain(round_, aborted, bound)
        spec = group_spec(round_, self.local_rank, self.where, self.group_timeout)
        clock = Phases()
        group = self.groups.form(spec, ready=ready, aborted=aborted, check=bound.check)  # leavable until all arrived
        sync = not state_follows(self.groups.ready_values(spec))  # the same values, so the same answer, everywhere
        clock.mark("group")
        watch = self._watch(round_, group)
        try:
            # in place on the first try only: a try interrupted may leave a collective of its build (the module's
            # broadcast) to land in the buffers it took over, so a later try copies the model off them
            return self._fill(round_, bound, holdings, start, group, watch, clock, in_place=old is not None, sync=sync)
        except BaseException:
            if watch is not None:  # the entry is thrown away whole: its watch must not abort a later round's group
                watch.close()
            raise

    def _fill(
        self,
        round_: NodeRound,
        bound: BoundedWait,
        holdings: Holdings,
        start: Start,
        group: Any,
        watch: Any,
        clock: Phases,
        *,
        in_place: bool,
        sync: bool,
    ) -> tuple[RoundState, bool]:
        """Build at ``group``'s world (a kept model's buffers taken over where ``in_place``: :meth:`_kept`; the
        module's broadcast left out unless ``sync``: :meth:`_make`), fill it from ``holdings`` (or the disk:
        ``resume``), re-cut the sampler. The build and the load are bounded like the step's waits (their
        collectives: the engine's broadcast of the module, DCP's load): a member frozen there leaves them for the
        agent's next round."""
        built = bound.call(lambda: self._make(group, in_place, sync), peer_failure)
        clock.mark("build")
        try:
            return self._fill_built(round_, bound, holdings, start, watch, built, clock)
        except BaseException:
            release_optimizer(optimizer_of(built))  # the entry is thrown away: its model and optimizer with it
            raise

    def _make(self, group: Any, in_place: bool, sync: bool) -> Any:
        """The round's ``build``: on this process's model of the round it leaves where it keeps it (:meth:`_kept`),
        else afresh; told ``sync_module_states=False`` where some member holds state (not ``sync``: the reshard
        writes every member's model state) and the builds take that keyword (:meth:`_unsynced`)."""
        kept = self._kept(in_place)
        options = {} if sync or not self._unsynced() else {"sync_module_states": False}
        return self.build(group, **options) if kept is None else self.rebuild(group, kept, **options)  # type: ignore[misc]

    def _unsynced(self) -> bool:
        """Whether the builds can leave the module's broadcast out: ``build`` and ``rebuild`` (where given) both take a
        ``sync_module_states`` keyword — the same on every process, which runs the same script: every member of a
        round broadcasts, or none."""
        builds: list[Callable[..., Any]] = [self.build, *([self.rebuild] if self.rebuild is not None else [])]
        return all(accepts(b, "sync_module_states") for b in builds)

    def _kept(self, in_place: bool) -> Any:
        """The module a survivor keeps (:meth:`_keeps`) — its settled round's, unwrapped (:meth:`ZeroOptimizer.unwrap`:
        that round's optimizer released) — or None. Without a copy where ``in_place`` and every master of the old
        optimizer views the parameters' buffers (not offloaded: a push of the host's step may still be on its way
        there): the parameters stay in those buffers, which the new wrap takes over (the holdings were detached from
        them); else with one."""
        old = getattr(self, "now", None)
        if old is None or not self._keeps(old):
            return None
        return old.opt.unwrap(copy=not (in_place and self._keeps_buffers(old)))

    def _keeps(self, old: RoundState) -> bool:
        """Whether this process keeps its model of round ``old`` (a settled round) into the next: a ``rebuild``, an
        optimizer whose module can be wrapped again."""
        return self.rebuild is not None and _rewrappable(old.opt)

    def _keeps_buffers(self, old: RoundState) -> bool:
        """Whether it keeps the model's buffers too, on an entry's first try (:meth:`_kept`): every master of the old
        optimizer views them (not offloaded)."""
        opt = old.opt
        return self._keeps(old) and all(opt.master_views_params(i) for i in range(len(opt.masters)))

    def _fill_built(
        self,
        round_: NodeRound,
        bound: BoundedWait,
        holdings: Holdings,
        start: Start,
        watch: Any,
        built: Any,
        clock: Phases,
    ) -> tuple[RoundState, bool]:
        """:meth:`_fill` once ``built`` exists (see there)."""
        opt = optimizer_of(built)
        opt.communicator = Communicator(opt.process_group, owner=type(opt).__name__, waiter=bound)
        plan = reshard_from(opt, holdings)
        clock.mark("reshard")
        mine: Position = None
        if holdings.owner is not None:
            mine = (start.step, _sampler(start).state_dict(), start.carried)
        at = resume_point(plan, opt.communicator.all_gather_object(mine, tag="reshard"))
        template = template_of(start.sampler, built)
        if at is None:  # the job's first round: the engine state as built, or the disk checkpoint's (resume)
            resume = self.resume
            step = bound.call(lambda: resume(built, template), peer_failure) if resume is not None else start.step
            at = ResumeAt(step, template.state_dict(), 0)
        else:
            carry(built, at)
        caught_up = holdings.owner is not None and caught_up_with(at.step, start.step)
        sampler = recut(template, at.position, at.behind, opt.rank, opt.world_size)
        clock.mark("agree")
        seed = Seed(plan, holdings.states) if isinstance(plan, ReshardPlan) else None  # the reshard's sources
        copies = self._make_copies(opt, at.step, bound, getattr(built, "copies_config", None), seed)
        clock.mark("copies")
        return RoundState(round_, bound, watch, built, opt, copies, sampler, at.step, clock.seconds()), caught_up

    def _watch(self, round_: NodeRound, group: Any) -> RoundWatch | None:
        """Under NCCL (:func:`aborts_on_announce`), a watch that aborts ``group`` once a newer round is announced and
        every member of it is ready (:meth:`_announced`)."""
        if aborts_on_announce(str(dist.get_backend(group))):
            poll = functools.partial(self._announced, round_.number, loop=False)
            return RoundWatch(poll, group.abort, self.poll_s)
        return None

    def _announced(self, number: int, *, urgent: bool = False, loop: bool = True) -> NodeRound | RoundError | None:
        """The round file's decision for the members of round ``number``: a newer round once every one of its members
        is ready to switch (:meth:`RoundGroups.ready <elasticzero.live.group.RoundGroups.ready>`: meanwhile this
        process trains on in its round — a joiner's worker is starting), at once when it does not name this process
        (its entry fails with one line) or is no round, while this process enters round ``number`` (it trains in
        none), and when ``urgent`` (a step's collective failed: it completes nowhere — decided so for the members
        unless they decided already). Else when the members' decision says (:meth:`_switch_at`): at once, or — a join
        — from the agreed step on, which only the loop itself leaves at (``loop`` False, the NCCL watch's thread:
        never; the loop drains its device at that boundary, then leaves, :meth:`_enter`)."""
        found = self.rounds.poll(number)
        if not isinstance(found, NodeRound) or found.rank_of(self.local_rank) is None:
            return found
        spec = group_spec(found, self.local_rank, self.where, self.group_timeout)
        values = self.groups.ready(spec, self._ready_value())
        if values is None:
            return None
        old = self._settled_round()
        if old is None or old.number != number:
            return found
        at = self._switch_at(found, spec, values, loop, urgent)
        if urgent or at == AT_ONCE:
            return found
        return found if loop and at is not None and switches(self.step, at) else None

    def _switch_at(self, found: NodeRound, spec: Any, values: list[str], loop: bool, urgent: bool) -> int | None:
        """The members' decision for ``found`` (:data:`~elasticzero.rounds.AT_ONCE`, or the step they switch at),
        read from the round's store once per round (:meth:`RoundGroups.switch_at
        <elasticzero.live.group.RoundGroups.switch_at>`), else decided here over ``values``
        (:func:`~elasticzero.rounds.switch_decision`: a join's step is :func:`switch_proposal` for where the loop is,
        which the watch's thread does not know — it decides only :data:`~elasticzero.rounds.AT_ONCE`; ``urgent``: a
        failed wait, which leaves its step — the peers' cannot complete — decides that too); None while nothing is
        decided."""
        if self._switch is not None and self._switch[0] == found.number:
            return self._switch[1]
        old = self.now.round
        assert old is not None, "a settled live round"
        where = "step" if self.in_attempt else "enter" if self.entering else "idle"
        step = switch_proposal(where, self.step, old.world_size, self.end)
        proposal = AT_ONCE if urgent else switch_decision(values, old.number, old.world_size, step)
        at = self.groups.switch_at(spec, proposal if loop or proposal == AT_ONCE else None)
        if at is not None:
            self._switch = (found.number, at)
        return at

    def _drain(self, round_: NodeRound, aborted: bool, bound: BoundedWait) -> None:
        """NCCL, leaving at a join's agreed step (its watch did not abort the old group): wait, bounded, until this
        device ran the old round's work — a step's trailing collective (the stage's all-gather after the update) may
        still run there, and a peer's host may wait on it: aborted now, it would never complete there."""
        agreed = self._switch is not None and self._switch[0] == round_.number and self._switch[1] != AT_ONCE
        device = self.where.bound_device
        if agreed and not aborted and device is not None:
            bound.call(lambda: torch.cuda.synchronize(torch.device(device)), peer_failure)

    def _settled_round(self) -> NodeRound | None:
        """The round this process trains in (None before its first is entered)."""
        now: RoundState | None = getattr(self, "now", None)
        return now.round if now is not None else None

    def _ready_value(self) -> str:
        """What this process says when it is ready for a new round (:func:`~elasticzero.rounds.ready_value`): the
        round it trains in and its rank there; that it holds state once it left that round (an entry under way); that
        it is new before its first."""
        if self._leaving:
            return ready_value(None, holds=True)
        old = self._settled_round()
        rank = old.rank_of(self.local_rank) if old is not None else None
        return ready_value(None if old is None or rank is None else (old.number, rank))

    def _bound(self, round_: NodeRound) -> BoundedWait:
        poll = functools.partial(self._announced, round_.number)
        urgent = functools.partial(self._announced, round_.number, urgent=True)
        device = self.where.bound_device  # the helper thread's CUDA device (the build runs there)
        grace, lost = self.failure_grace_s, self.groups.lost  # lost: the current group's connections (gloo)
        return BoundedWait(poll, poll_s=self.poll_s, failure_grace_s=grace, device=device, lost=lost, urgent=urgent)

    def _make_copies(
        self, opt: ZeroOptimizer, step: int, bound: BoundedWait, config: Any, seed: Seed | None = None
    ) -> BuddyCopies:
        """The round's copies: the constructor's settings, or ``config`` (what ``build`` returned says: a config's
        ``zero.copies``, with ``enabled``, ``node_shift``, ``overlap``, ``early``) when given; ``seed``: the round's
        reshard, whose sources make the first copies of the wards they sent a whole state (not mirrored back)."""
        nodes = self.nodes(opt.world_size) if self.nodes is not None else None
        r = config
        on, shift = (self.replicate, self.node_shift) if r is None else (r.enabled, r.node_shift)
        overlap, early = (self.overlap, self.early) if r is None else (r.overlap, r.early)
        return BuddyCopies(
            opt, nodes=nodes, step=step, waiter=bound, enabled=on, node_shift=shift, overlap=overlap, early=early,
            seed=seed,
        )  # fmt: skip


def warm_up() -> None:
    """Before a live process's first round: pay once what would otherwise land on a round change's path.

    - torch's first optimizer imports its compiler stack (``Optimizer.__init__``: 0.7 s on this project's 2-core
      test machine). A joining process says it is ready when its first formation starts, and its running peers then
      wait for its build: paid here, they train on meanwhile.
    - every object alive now (the interpreter's, torch's and the script's: ~300k) is moved out of the cyclic
      collector's sight (``gc.freeze``): the let-go after a round change collects the old round's cycles with a full
      collection, which held the interpreter's lock 0.12 s beside the new round's first step scanning them; frozen,
      it scans the rounds' objects alone. Nothing made from here on (models, optimizers, groups) is frozen, nor
      anything already garbage (collected first)."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    gc.collect()
    gc.freeze()


class Phases:
    """The seconds an entry spends in each phase, marked as each ends (:attr:`RoundState.entry`)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.spent: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.spent[phase], self.last = now - self.last, now

    def seconds(self) -> dict[str, float]:
        return dict(self.spent)


@dataclass(frozen=True)
class Start:
    """Where an entry starts from: the last settled round's step, sampler and engine state (:func:`held_state`), or
    the job's start (a sampler source, no engine state)."""

    step: int
    sampler: SamplerSource
    carried: dict[str, Any] = field(default_factory=dict)


def _sampler(start: Start) -> ElasticSampler:
    assert isinstance(start.sampler, ElasticSampler), "a survivor's start is a settled round's sampler"
    return start.sampler


def release(state: RoundState) -> None:
    """Let go of a round left for good, waiting for nothing of its group (a lost peer may leave a wait of it pending
    for good): its copies abandoned (:meth:`BuddyCopies.abandon`), its optimizer's hooks on its model off
    (:func:`release_optimizer`) — else the old model, optimizer and copies stay alive for the life of the process."""
    if state.copies is not None:
        state.copies.abandon()
    release_optimizer(state.opt)


def _rewrappable(opt: Any) -> bool:
    return bool(getattr(opt, "rewrappable", lambda: False)())


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (False for a callable without a signature: a C builtin)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def release_optimizer(opt: Any) -> None:
    """``opt.release()`` where it has one (a ZeRO optimizer: its hooks on the model's parameters, which autograd
    holds in C++, out of Python's collector's sight)."""
    if hasattr(opt, "release"):
        opt.release()


def caught_up_with(step: int, in_flight: int) -> bool:
    """A survivor at the reshard's ``step``: its step in flight (``in_flight``) counted done when its commit gate
    passed everywhere (``step`` one past it), else redone; any other distance is a :class:`LiveError`."""
    if step not in (in_flight, in_flight + 1):
        raise LiveError(f"the in-memory reshard is at step {step}, this rank was at step {in_flight}")
    return step == in_flight + 1


def _first_step(event: RoundEvent, at: float) -> RoundEvent:
    return RoundEvent(event.round, event.left_at, event.ready_at, event.step, at)


class Attempt:
    """One attempt at the step in flight: ``with attempt:`` around the step's work (see the module)."""

    def __init__(self, live: _Rounds, *, commits: bool = True) -> None:
        self.live, self.commits = live, commits
        #: after the ``with``: whether its body ran to its end in one round (``commits`` False: an attempt at work
        #: between steps that commits no step, e.g. the job's last save)
        self.completed = False
        #: the step this attempt is at (fixed when it begins; ``live.step`` moves on at its commit)
        self.number = live.step
        #: after the ``with``: whether the step committed — by this attempt, or (its round left after the step's
        #: commit gate passed on every member) by the reshard that counted it done. False: it was left for a new
        #: round before the gate and is attempted again — the ``with`` swallowed that, so code after it must look
        #: here before it counts the step. Every committed step reports True exactly once.
        self.committed = False

    @property
    def step(self) -> int:
        return self.live.step

    @property
    def opt(self) -> Any:
        return self.live.opt

    @property
    def model(self) -> Any:
        return self.live.model

    @property
    def micro_batches(self) -> list[list[int]]:
        return self.live.micro_batches

    def check(self) -> None:
        """Leave the attempt now (:class:`Reconfigure`) if a newer round is in the round file: for a body that waits
        on something other than the engine's collectives."""
        self.live.bound.check()

    def __enter__(self) -> Attempt:
        self.live.entering = True
        try:
            self.live.bound.check()  # a round announced between two steps
        except Reconfigure as leave:
            self.live.reconfigure(leave.round)
        finally:
            self.live.entering = False
        self.number, self.live.in_attempt = self.live.step, True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        self.live.in_attempt = False
        if exc is None:
            self.completed = True
            if self.commits:
                self.live.commit()
                self.committed = True
            return False
        abandoned = self.live.bound.abandoned  # set by the wait that left (autograd may wrap its Reconfigure)
        if abandoned is None and isinstance(exc, RuntimeError) and peer_failure(exc):
            try:  # torch's and gloo's errors where collectives are issued: a peer may be gone
                self.live.bound.after_failure(exc)
            except Reconfigure as leave:
                abandoned = leave.round
            except BaseException:
                return False  # no round came: the failure is the step's own
        if abandoned is None:
            return False  # the step's own error (the user's, an out-of-memory): raised at once
        self.live.reconfigure(abandoned)
        self.committed = self.commits and self.live.step > self.number  # the reshard counted this step done
        return True
