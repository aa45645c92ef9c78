"""The loop construct: one ``with`` per step in the user's loop; a step left for a new round is redone there.

::

    live = LiveTraining(build, sampler=sampler, source=RoundSource(store), first=Round(0, members, "round0/"))
    for attempt in live.steps(total):
        with attempt:                                   # the one construct
            for idx in attempt.micro_batches:           # this rank's sample indices, micro-batch by micro-batch
                loss_of(attempt.model, data[idx]).backward()
            attempt.opt.step()
            attempt.opt.zero_grad()

``build(group)`` makes the model and its ZeRO optimizer on a process group (called once per round, on a model built
afresh: the reshard reads the old one). The attempt's ``with`` leaves on :class:`~elasticzero.live.bounded.Reconfigure`
(any wait of the step's collectives left for a newer round), then, in the same process:

1. this process's holdings (its own state and its wards' copies, :meth:`Replicator.holdings`) are taken from the old
   round, whose group is abandoned (never used again, never destroyed: see :mod:`.bounded`);
2. the new group is formed (``dist.new_group`` of the members, with the old ranks' order kept, on the job's store);
3. ``build(group)`` at the new world, its communicator bounded by a watch of the new round,
   :func:`~elasticzero.engine.zero.reshard.reshard_from` fills it from the holdings; a
   :class:`~elasticzero.engine.zero.reshard.Fallback` raises :class:`ReshardFallback` (the restart path loads the disk
   checkpoint);
4. a new :class:`Replicator` for the new world; the sampler rebuilt at the new rank and world from the position of the
   reshard's step (the global batch is kept: each rank's share of it is re-cut);
5. the loop goes on at the reshard's step: the step in flight is redone unless its commit gate had passed everywhere,
   when it counts as done. No committed step is redone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist

from elasticzero.data.sampler import ElasticSampler
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.comm import Communicator
from elasticzero.engine.zero.replica import Replicator
from elasticzero.engine.zero.reshard import Fallback, reshard_from
from elasticzero.errors import UsageError
from elasticzero.live.bounded import BoundedWait, LiveError, Reconfigure
from elasticzero.live.rounds import Round, RoundSource


class ReshardFallback(LiveError):
    """Both copies of some state are lost (or the survivors are a step apart): load the disk checkpoint."""

    def __init__(self, fallback: Fallback) -> None:
        super().__init__(f"in-memory reshard impossible: {fallback.reason}; restart from the disk checkpoint")
        self.fallback = fallback


@dataclass(frozen=True)
class RoundEvent:
    """One reconfiguration: the round, when this process left the old group, when the new state was in place, the
    step it resumed at, and when the first step at the new world completed (``None`` until it did)."""

    round: Round
    left_at: float
    ready_at: float
    step: int
    first_step_at: float | None = None


def new_group_ranks(round_: Round, global_ranks: Sequence[int]) -> list[int]:
    """The default-group ranks of the round's members in new-rank order (``global_ranks[r]``: old rank ``r``'s); a
    :class:`LiveError` when the round reorders them (groups keep the default group's order)."""
    ranks = [global_ranks[old] for old in round_.old_ranks() if 0 <= old < len(global_ranks)]
    if len(ranks) != round_.world_size or ranks != sorted(ranks):
        raise LiveError(f"round {round_.number}: members {dict(round_.members)} are not old ranks in their order")
    return ranks


def resampled(old: ElasticSampler, rank: int, world_size: int) -> ElasticSampler:
    """``old``'s sampler at another rank and world size, at ``old``'s position (a global-batch boundary)."""
    new = ElasticSampler(
        old.num_samples,
        global_batch_size=old.global_batch_size,
        micro_batch_size=old.micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=old.seed,
        shuffle=old.shuffle,
    )
    new.load_state_dict(old.state_dict())
    return new


class LiveTraining:
    """A ZeRO training job that survives membership changes in its processes (see the module).

    Args:
        build: ``build(group) -> ZeroOptimizer`` (a fresh model and its optimizer on ``group``).
        sampler: this rank's :class:`ElasticSampler` at the first round (the loop moves it; never iterate it).
        source: the :class:`RoundSource` the waits poll.
        first: the round the job starts in (its members: the default group's ranks, or ``group``'s).
        group: the first round's process group (default: the default group).
        nodes: ``nodes(world_size)``, the node of every rank of a round (the buddy placement); default: gathered.
        poll_s, failure_grace_s: the bound of the waits (:class:`BoundedWait`).
        group_timeout: the collective timeout of the groups it forms.
        start_step: the step the job starts at (a job resumed from a checkpoint: its step; ``sampler`` at its
            position).
    """

    def __init__(
        self,
        build: Callable[[Any], ZeroOptimizer],
        *,
        sampler: ElasticSampler,
        source: RoundSource,
        first: Round,
        group: Any = None,
        nodes: Callable[[int], Sequence[Hashable]] | None = None,
        poll_s: float = 0.05,
        failure_grace_s: float = 30.0,
        group_timeout: timedelta = timedelta(minutes=5),
        start_step: int = 0,
    ) -> None:
        self.build, self.source, self.nodes = build, source, nodes
        self.poll_s, self.failure_grace_s, self.group_timeout = poll_s, failure_grace_s, group_timeout
        self.round, self.sampler, self.step = first, sampler, start_step
        self.group = group if group is not None else dist.group.WORLD
        self.global_ranks = dist.get_process_group_ranks(self.group)
        if first.world_size != len(self.global_ranks):
            raise UsageError(
                f"LiveTraining: the first round has {first.world_size} member(s) but its group {len(self.global_ranks)}"
                " rank(s): name every rank of the group in first.members"
            )
        self.record: list[tuple[int, list[int]]] = []  # (step, this rank's samples) of every committed step
        self.events: list[RoundEvent] = []
        self.bound = self._bound(first)
        self.opt = self._bounded(build(self.group))
        self.replicator = self._replicate(start_step)

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

    def close(self) -> None:
        """Stop the copies (the last round's group stays the caller's)."""
        self.replicator.close()
        self.bound.close()

    # -- commit and reconfigure ---------------------------------------------------------------------------------------
    def commit(self) -> None:
        """The step in flight completed: record its samples, move the sampler one global batch on."""
        self.record.append((self.step, [i for mb in self.micro_batches for i in mb]))
        self.sampler.advance(self.sampler.accumulation_steps)
        self.step += 1
        if self.events and self.events[-1].first_step_at is None:
            self.events[-1] = _first_step(self.events[-1], time.monotonic())

    def reconfigure(self, round_: Round) -> None:
        """Leave the old round for ``round_`` in this process (steps 1-5 of the module)."""
        left_at = time.monotonic()
        new_rank = round_.new_rank(self.rank)
        if new_rank is None:
            raise LiveError(f"rank {self.rank} of round {self.round.number} is not a member of round {round_.number}")
        ranks = new_group_ranks(round_, self.global_ranks)
        holdings = self.replicator.holdings()
        group = dist.new_group(ranks, timeout=self.group_timeout, use_local_synchronization=True)
        self.bound = self._bound(round_)
        opt = self._bounded(self.build(group))
        plan = reshard_from(opt, holdings)
        if isinstance(plan, Fallback):
            raise ReshardFallback(plan)
        self._reposition(plan.step, new_rank, round_.world_size)
        self.round, self.group, self.global_ranks, self.opt = round_, group, ranks, opt
        self.replicator = self._replicate(plan.step)
        self.events.append(RoundEvent(round_, left_at, time.monotonic(), plan.step))

    def _reposition(self, step: int, rank: int, world_size: int) -> None:
        """The sampler at the reshard's ``step``, for the new rank and world: the step in flight is redone, or counted
        done when its commit gate passed everywhere (``step`` one past it)."""
        if step == self.step + 1:
            self.commit()
        if step != self.step:
            raise LiveError(f"the in-memory reshard is at step {step}, this rank was at step {self.step}")
        self.sampler = resampled(self.sampler, rank, world_size)

    def _bound(self, round_: Round) -> BoundedWait:
        poll = functools.partial(self.source.poll, round_.number)
        return BoundedWait(poll, poll_s=self.poll_s, failure_grace_s=self.failure_grace_s)

    def _bounded(self, opt: ZeroOptimizer) -> ZeroOptimizer:
        opt.communicator = Communicator(opt.process_group, owner=type(opt).__name__, waiter=self.bound)
        return opt

    def _replicate(self, step: int) -> Replicator:
        nodes = self.nodes(self.opt.world_size) if self.nodes is not None else None
        return Replicator(self.opt, nodes=nodes, step=step, waiter=self.bound)


def _first_step(event: RoundEvent, at: float) -> RoundEvent:
    return RoundEvent(event.round, event.left_at, event.ready_at, event.step, at)


class Attempt:
    """One attempt at the step in flight: ``with attempt:`` around the step's work (see the module)."""

    def __init__(self, live: LiveTraining) -> None:
        self.live = live

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

    def __enter__(self) -> Attempt:
        try:
            self.live.bound.check()  # a round announced between two steps
        except Reconfigure as leave:
            self.live.reconfigure(leave.round)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None:
            self.live.commit()
            return False
        abandoned = self.live.bound.abandoned  # set by the wait that left (autograd may wrap its Reconfigure)
        if abandoned is None and isinstance(exc, RuntimeError):  # torch's and gloo's errors: a peer may be gone
            try:
                self.live.bound.after_failure(exc)
            except Reconfigure as leave:
                abandoned = leave.round
            except BaseException:
                return False  # no round came: the failure is the step's own
        if abandoned is None:
            return False
        try:
            self.live.reconfigure(abandoned)
        except Reconfigure as again:  # the reconfiguration is not itself bounded against a second change (yet)
            raise LiveError(f"round {again.round.number} announced during the reconfiguration") from again
        return True
