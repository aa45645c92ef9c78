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

``build(group)`` makes the model and its ZeRO optimizer on a process group (called once per round, on a model built
afresh: the reshard reads the old one). Every round — the first one too — is entered the same way, by survivors and
fresh processes alike (:meth:`LiveTraining._enter`):

1. the round's group is formed: a fresh default group on the round's store and prefix (:mod:`.group`; the previous
   one, if any, is left and kept referenced);
2. ``build(group)`` at the round's world, its communicator bounded by a watch of the round file;
   :func:`~elasticzero.live.reshard.reshard_from` fills it from what the members hold (a survivor: its own
   state and its wards' copies, :meth:`BuddyCopies.holdings`; a fresh process: nothing);
3. the group decides where training goes on (:func:`resume_point`, pure over the plan and the members' sampler
   positions, all-gathered): nobody holds state → the job's first round (the state as built, or the caller's
   ``resume``: a disk checkpoint); else the reshard's step, the sampler position from the holder of old rank 0's state
   (a fresh process learns both from its peers); some state lost → :class:`ReshardFallback` (the restart path);
4. a survivor whose step in flight had passed its commit gate everywhere counts it done (the reshard is one step
   ahead); the sampler is re-cut at the new rank and world (the global batch is kept);
5. a new :class:`BuddyCopies` for the new world.

The attempt's ``with`` leaves on :class:`~elasticzero.live.bounded.Reconfigure` (any wait of the step's collectives
left for a newer round) and enters the new round in the same process; a newer round arriving while it does starts the
entry over with it. No committed step is redone.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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
from elasticzero.live.bounded import BoundedWait, LiveError, Reconfigure
from elasticzero.live.copies import BuddyCopies
from elasticzero.live.group import RoundGroups, RoundWatch, aborts_on_announce, group_spec
from elasticzero.live.reshard import Fallback, Holdings, ReshardPlan, reshard_from
from elasticzero.live.rounds import ROUND_FILE_ENV, NodeRound, RoundError, RoundFile
from elasticzero.progress import reporter


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
    """Where a round's training goes on: ``step``, and the sampler ``position`` (a state dict) ``behind`` global
    batches before it (the source's step in flight counted done by the reshard)."""

    step: int
    position: dict[str, Any]
    behind: int


#: one member's sampler position for the agreement: (its step, its sampler's state dict); None for a fresh process
Position = tuple[int, dict[str, Any]] | None


def resume_point(plan: ReshardPlan | Fallback, positions: Sequence[Position]) -> ResumeAt | None:
    """The group's decision (the same on every member): ``None`` when nobody holds state (the job's first round), the
    reshard's step with the source's sampler position otherwise; :class:`ReshardFallback` when some state is lost, a
    :class:`LiveError` when the source's position does not lead to the reshard's step."""
    if isinstance(plan, Fallback):
        if plan.nothing_held:
            return None
        raise ReshardFallback(plan)
    src = positions[plan.sources[0]]  # the holder of old rank 0's state: a member that held state
    if src is None or not 0 <= plan.step - src[0] <= 1:
        raise LiveError(f"the in-memory reshard is at step {plan.step}, its source's sampler at {src and src[0]}")
    return ResumeAt(plan.step, src[1], plan.step - src[0])


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


class LiveTraining:
    """A ZeRO training job that survives membership changes in its processes (see the module).

    Build it with :meth:`from_agent` under the agent; the constructor takes the pieces explicitly.

    Args:
        build: ``build(group) -> ZeroOptimizer`` (a fresh model and its optimizer on ``group``).
        sampler: the job's :class:`ElasticSampler` at its start position (the loop re-cuts it for each round's rank
            and world, and moves it; never iterate it). A process joining a running job takes the position from its
            peers; the settings (samples, global batch, micro batch, seed) must be the job's.
        rounds: the :class:`RoundFile` the waits poll; ``first``: the round this process starts in.
        local_rank: this process's local rank (its entry in the round's ranks).
        where: the device and backend (:func:`elasticzero.device.placement`); default: CPU over gloo.
        nodes: ``nodes(world_size)``, the node of every rank of a round (the buddy placement); default: gathered.
        poll_s, failure_grace_s: the bound of the waits (:class:`BoundedWait`).
        group_timeout: the collective timeout of the groups it forms (default: the placement's, the launcher's).
        resume: the job's first round only (nobody holds state): ``resume(opt) -> step`` loads the disk checkpoint
            into the optimizer as built and returns its step (``sampler`` given at that step's position); default:
            the state as built, at ``start_step``.
        start_step: the step a fresh job starts at without ``resume``.
        replicate, node_shift, overlap, early: the buddy copies (:class:`BuddyCopies`'s ``enabled``, ``node_shift``,
            ``overlap``, ``early``; a config's ``zero.copies``): without copies a lost node's state is lost, and its
            loss falls back to the disk checkpoint (``ReshardFallback``).
    """

    opt: ZeroOptimizer
    copies: BuddyCopies
    bound: BoundedWait

    def __init__(
        self,
        build: Callable[[Any], ZeroOptimizer],
        *,
        sampler: ElasticSampler,
        rounds: RoundFile,
        first: NodeRound,
        local_rank: int = 0,
        where: Placement | None = None,
        nodes: Callable[[int], Sequence[Hashable]] | None = None,
        poll_s: float = 0.05,
        failure_grace_s: float = 30.0,
        group_timeout: timedelta | None = None,
        resume: Callable[[ZeroOptimizer], int] | None = None,
        start_step: int = 0,
        replicate: bool = True,
        node_shift: int = 1,
        overlap: bool = True,
        early: bool = True,
    ) -> None:
        self.build, self.rounds, self.nodes, self.resume = build, rounds, nodes, resume
        self.replicate, self.node_shift, self.overlap, self.early = replicate, node_shift, overlap, early  # copies
        self.local_rank, self.where = local_rank, where or Placement("cpu", "gloo", alone=False)
        self.poll_s, self.failure_grace_s, self.group_timeout = poll_s, failure_grace_s, group_timeout
        self.sampler, self.step, self.round = sampler, start_step, first
        self.groups = RoundGroups()  # every round's group, the abandoned ones kept
        self.watch: RoundWatch | None = None  # NCCL: aborts the round's group when a newer one is announced
        self.record: list[tuple[int, list[int]]] = []  # (step, this rank's samples) of every committed step
        self.events: list[RoundEvent] = []
        self._enter_until_settled(first, Holdings())

    @classmethod
    def from_agent(
        cls,
        build: Callable[[Any], ZeroOptimizer],
        *,
        sampler: ElasticSampler,
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
    def rank(self) -> int:
        return self.opt.rank

    @property
    def model(self) -> Any:
        return self.opt.module

    @property
    def micro_batches(self) -> list[list[int]]:
        """This rank's sample indices of the step in flight, one list per micro-batch."""
        s = self.sampler
        starts = range(s.consumed, s.consumed + s.global_batch_size, s.micro_step)
        return [s.micro_batch(s.epoch, p) for p in starts]

    def steps(self, total: int) -> Iterator[Attempt]:
        """Attempts until ``total`` steps are committed (a step left for a new round is attempted again)."""
        while self.step < total:
            yield Attempt(self)

    def between_steps(self, work: Callable[[], None]) -> bool:
        """Run ``work`` — collectives of the round's group outside any step, e.g. the job's last checkpoint save after
        the loop — bounded like an attempt's waits. True once it completed; False when a newer round was announced
        (or a peer's loss failed it and the agent's round came) meanwhile: that round is entered here, ``work``
        abandoned as an attempt's (see :meth:`Attempt.bounded`); decide again there, over the new round's state,
        whether to redo it."""
        try:
            self.bound.check()
            self.bound(work)
            return True
        except Reconfigure as leave:
            round_ = leave.round
        except RuntimeError as err:  # issued on a group a lost peer's sockets closed: the agent's round is expected
            round_ = self._round_after(err)
        self.reconfigure(round_)
        return False

    def close(self) -> None:
        """Stop the copies (the last round's group stays the default group; the abandoned ones stay referenced)."""
        self.copies.close()
        self.bound.close()
        if self.watch is not None:
            self.watch.close()

    # -- commit and reconfigure ---------------------------------------------------------------------------------------
    def commit(self) -> None:
        """The step in flight completed: record its samples, move the sampler one global batch on."""
        self.record.append((self.step, [i for mb in self.micro_batches for i in mb]))
        self.sampler.advance(self.sampler.accumulation_steps)
        self.step += 1
        if self.events and self.events[-1].first_step_at is None:
            self.events[-1] = _first_step(self.events[-1], time.monotonic())

    def reconfigure(self, round_: NodeRound) -> None:
        """Leave the old round for ``round_`` in this process (see the module)."""
        left_at = time.monotonic()
        entered = self._enter_until_settled(round_, self.copies.holdings())
        self.events.append(RoundEvent(entered, left_at, time.monotonic(), self.step))

    def _enter_until_settled(self, round_: NodeRound, holdings: Holdings) -> NodeRound:
        """:meth:`_enter` ``round_``; a newer round in the file meanwhile (a second change) starts over with it, from
        the same holdings. Returns the round entered."""
        while True:
            try:
                self._enter(round_, holdings)
                return round_
            except Reconfigure as again:
                round_ = again.round
            except RuntimeError as err:  # a member lost meanwhile: its sockets closed, the agent's round is expected
                round_ = self._round_after(err)

    def _round_after(self, err: RuntimeError) -> NodeRound:
        if isinstance(err, LiveError):
            raise err
        try:
            self.bound.after_failure(err)
        except Reconfigure as leave:
            return leave.round
        raise err  # after_failure raises; for the type checker

    def _enter(self, round_: NodeRound, holdings: Holdings) -> None:
        """Form ``round_``'s group, build the optimizer at its world, fill it, position the sampler (the module's
        steps 1-5); the same code for a survivor (``holdings`` its own) and a fresh process (``Holdings()``)."""
        self.bound = self._bound(round_)  # first: a failure from here on waits for a round newer than this one
        reporter().entered_round()  # the hang watch: no step in this round yet (watched again from its first)
        if self.watch is not None:
            self.watch.close()
        aborted = self.watch is not None and self.watch.fired  # NCCL: the watch aborted the old group (final now)
        spec = group_spec(round_, self.local_rank, self.where, self.group_timeout)
        group = self.groups.form(spec, aborted=aborted, check=self.bound.check)  # leavable until all members arrived
        self._watch(round_, group)
        opt = self._bounded(self.build(group))
        plan = reshard_from(opt, holdings)
        mine: Position = (self.step, self.sampler.state_dict()) if holdings.owner is not None else None
        at = resume_point(plan, opt.communicator.all_gather_object(mine, tag="reshard"))
        if at is None:
            step = self.resume(opt) if self.resume is not None else self.step
            at = ResumeAt(step, self.sampler.state_dict(), 0)
        elif holdings.owner is not None:
            self._catch_up(at.step)
        self.sampler = recut(self.sampler, at.position, at.behind, opt.rank, opt.world_size)
        self.step, self.round, self.opt = at.step, round_, opt
        self.copies = self._make_copies(at.step)

    def _catch_up(self, step: int) -> None:
        """A survivor at the reshard's ``step``: its step in flight counted done when its commit gate passed everywhere
        (``step`` one past it), else redone."""
        if step == self.step + 1:
            self.commit()
        if step != self.step:
            raise LiveError(f"the in-memory reshard is at step {step}, this rank was at step {self.step}")

    def _watch(self, round_: NodeRound, group: Any) -> None:
        """Under NCCL (:func:`aborts_on_announce`), a watch that aborts ``group`` once a newer round is announced."""
        self.watch = None
        if aborts_on_announce(str(dist.get_backend(group))):
            poll = functools.partial(self.rounds.poll, round_.number)
            self.watch = RoundWatch(poll, group.abort, self.poll_s)

    def _bound(self, round_: NodeRound) -> BoundedWait:
        poll = functools.partial(self.rounds.poll, round_.number)
        return BoundedWait(poll, poll_s=self.poll_s, failure_grace_s=self.failure_grace_s)

    def _bounded(self, opt: ZeroOptimizer) -> ZeroOptimizer:
        opt.communicator = Communicator(opt.process_group, owner=type(opt).__name__, waiter=self.bound)
        return opt

    def _make_copies(self, step: int) -> BuddyCopies:
        nodes = self.nodes(self.opt.world_size) if self.nodes is not None else None
        return BuddyCopies(
            self.opt, nodes=nodes, step=step, waiter=self.bound,
            enabled=self.replicate, node_shift=self.node_shift, overlap=self.overlap, early=self.early,
        )  # fmt: skip


def _first_step(event: RoundEvent, at: float) -> RoundEvent:
    return RoundEvent(event.round, event.left_at, event.ready_at, event.step, at)


class Attempt:
    """One attempt at the step in flight: ``with attempt:`` around the step's work (see the module)."""

    def __init__(self, live: LiveTraining) -> None:
        self.live = live
        #: after the ``with``: whether the step committed (False: it was left for a new round and is attempted again —
        #: the ``with`` swallowed that, so code after it must look here before it counts the step)
        self.committed = False

    @property
    def step(self) -> int:
        return self.live.step

    @property
    def opt(self) -> ZeroOptimizer:
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

    def bounded(self, work: Callable[[], None]) -> None:
        """Run ``work`` — collectives of the round's group outside the engine, e.g. a checkpoint save — bounded like
        the engine's waits: on the bound's helper thread, left with :class:`Reconfigure` when a newer round is
        announced (the thread stays in the abandoned work; a save left so is fenced out of the directory by the new
        round's checkpointer)."""
        self.live.bound(work)

    def __enter__(self) -> Attempt:
        try:
            self.live.bound.check()  # a round announced between two steps
        except Reconfigure as leave:
            self.live.reconfigure(leave.round)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None:
            self.live.commit()
            self.committed = True
            return False
        abandoned = self.live.bound.abandoned  # set by the wait that left (autograd may wrap its Reconfigure)
        if abandoned is None and isinstance(exc, RuntimeError) and not isinstance(exc, LiveError):
            try:  # torch's and gloo's errors: a peer may be gone
                self.live.bound.after_failure(exc)
            except Reconfigure as leave:
                abandoned = leave.round
            except BaseException:
                return False  # no round came: the failure is the step's own
        if abandoned is None:
            return False
        self.live.reconfigure(abandoned)
        return True
