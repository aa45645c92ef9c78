"""Hung workers on a live node: the pure decision over the workers' progress records.

Each worker reports progress into a small record the agent reads (:mod:`elasticzero.progress`). On every monitor tick
the agent (thin I/O: :mod:`elasticzero.agent.hang`) reads the records and the processes' states into
:class:`Observed` values; :func:`observe` folds them into the :class:`Watch` (when each worker last changed, the step
times seen this round) and :func:`verdict` decides — torch's ``_RendezvousJoinOp`` shape: a snapshot and a clock in,
a decision out, nothing done here.

The rule (docs/agent.md, "Hung workers"):

* a worker is watched from its first reported step (start-up, the checkpoint load and the first step are bounded by
  the collective timeout only: their length says nothing about a hang), and after entering a live round (a hand-off,
  :mod:`elasticzero.live`) from its first step in it (the reshard or a joiner's state transfer, then the first step);
* the hang timeout is ``--hang-timeout`` or, by default, :data:`STEP_FACTOR` times the longest step interval seen
  since the workers started (the last :data:`HISTORY`), at least :data:`FLOOR_S` (the floor alone until two steps
  were seen). The interval that spans a live round change (the loss's detection, the re-rendezvous, the reshard) is
  no step: the worker's record counts the rounds it entered, and an interval across two is not counted;
* a worker without progress for the timeout that is *not* waiting in an engine collective (or is stopped: SIGSTOP, a
  debugger) is hung. Its peers, blocked in the collective it never entered, show the collective they wait in: they
  are declared only after :data:`VICTIM_FACTOR` times the timeout, which leaves the hung rank's own agent time to act
  (its workers' exit fails their collective first). Several hung local workers: the one behind (fewest collectives
  issued) is named. A worker in a live loop's bounded wait on other work (a checkpoint save's collectives on the
  bound's helper thread) is not in an engine collective: the rule above applies, and the hang line says where it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from elasticzero.agent.agentdirs import agent_dir
from elasticzero.device import parse_seconds
from elasticzero.progress import PROGRESS_FILE_ENV, ProgressRecord

#: the hang timeout's lower bound when derived (seconds): above a loaded machine's scheduling and GC pauses
FLOOR_S = 30.0
#: the derived timeout is this many times the longest step interval seen in the round
STEP_FACTOR = 10.0
#: a worker waiting in an engine collective is declared hung only after this many hang timeouts
VICTIM_FACTOR = 2.0
#: step intervals remembered per round (the most recent)
HISTORY = 64
#: ``--hang-timeout`` values that turn the detection off
OFF = frozenset({"0", "off", "none"})


@dataclass(frozen=True)
class HangPlan:
    """The agent's hang detection: its timeout rule and where the workers' records live."""

    enabled: bool
    timeout_s: float | None  #: ``--hang-timeout``; None: derived from the step times (:func:`hang_timeout`)
    progress_dir: str | None  #: the agent's private directory of records (one file per local rank)
    floor_s: float = FLOOR_S
    factor: float = STEP_FACTOR

    def record_file(self, local_rank: int) -> str | None:
        """The record file of ``local_rank`` (None when the detection is off)."""
        return None if self.progress_dir is None else os.path.join(self.progress_dir, f"rank{local_rank}")

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """What the agent's start hook adds to ``local_rank``'s environment: its record file."""
        path = self.record_file(local_rank)
        return {} if path is None else {PROGRESS_FILE_ENV: path}


#: no hang detection (an agent built without a plan)
NO_HANG = HangPlan(enabled=False, timeout_s=None, progress_dir=None)


def hang_plan(flag: str | None, environ: Mapping[str, str], job_id: str, agent_pid: int) -> HangPlan:
    """``--hang-timeout`` (seconds, or ``off``/``0``; default: derived) and the records' directory: under ``$TMPDIR``
    (else ``/tmp``), named by job and agent pid, created by the agent when it starts."""
    if flag is not None and flag.strip().lower() in OFF:
        return NO_HANG
    timeout = None if flag is None else parse_seconds(flag, f"--hang-timeout {flag} (or 'off')")
    return HangPlan(True, timeout, agent_dir(environ, "progress", job_id, agent_pid))


@dataclass(frozen=True)
class Observed:
    """One worker on one monitor tick: its identity, its record (None: none yet) and whether it is stopped."""

    rank: int
    local_rank: int
    pid: int
    record: ProgressRecord | None
    stopped: bool = False


@dataclass(frozen=True)
class Seen:
    """What the watch remembers of one worker: its last marks, since when (agent's monotonic clock), its last step."""

    pid: int
    marks: tuple[int, ...]
    since: float
    step: int
    step_ns: int
    rounds: int = 0  #: live rounds the worker had entered (:attr:`~elasticzero.progress.ProgressRecord.rounds`)


@dataclass(frozen=True)
class Watch:
    """The agent's memory of this round's workers (per local rank) and the step intervals seen (seconds)."""

    seen: Mapping[int, Seen] = field(default_factory=lambda: MappingProxyType({}))
    gaps: tuple[float, ...] = ()
    #: pids already stopped as hung: never named again (the kill takes a tick or more to show as a failure)
    stopped: frozenset[int] = frozenset()


def stopping(watch: Watch, pid: int) -> Watch:
    """The watch once ``pid`` was stopped as hung."""
    return replace(watch, stopped=watch.stopped | {pid})


def observe(watch: Watch, workers: Sequence[Observed], now: float) -> Watch:
    """The watch after seeing ``workers`` at ``now``: changed marks (or a round entered) restart a clock; new steps
    add intervals (:func:`step_interval`)."""
    seen, gaps = dict(watch.seen), list(watch.gaps)
    for w in workers:
        rec, old = w.record, watch.seen.get(w.local_rank)
        if rec is None or rec.pid != w.pid:
            seen.pop(w.local_rank, None)
            continue
        if old is None or old.pid != w.pid or old.marks != rec.marks or old.rounds != rec.rounds:
            seen[w.local_rank] = Seen(w.pid, rec.marks, now, rec.step, rec.step_ns, rec.rounds)
        gap = step_interval(old, w.pid, rec)
        if gap is not None:
            gaps.append(gap)
    return Watch(MappingProxyType(seen), tuple(gaps[-HISTORY:]), watch.stopped)


def step_interval(old: Seen | None, pid: int, rec: ProgressRecord) -> float | None:
    """The length of one step between the last observation (``old``) and ``rec``, from the worker's own clock; None
    when there is none: another process, no new step, or no step time before it — the first step of the process or
    of a live round, whose interval spans the start-up or the round change (a round entered clears the step time and
    counts in ``rounds``: an interval across two rounds is not counted, however the observations fell)."""
    if old is None or old.pid != pid or rec.step <= old.step or rec.beats == 0:
        return None
    if not old.step_ns or not rec.step_ns or old.rounds != rec.rounds:
        return None
    return (rec.step_ns - old.step_ns) / 1e9 / (rec.step - old.step)


def hang_timeout(plan: HangPlan, gaps: Sequence[float]) -> float:
    """The hang timeout now: the flag's, else ``max(floor, factor * longest step interval seen)``."""
    if plan.timeout_s is not None:
        return plan.timeout_s
    return max(plan.floor_s, plan.factor * max(gaps, default=0.0))


def timeout_source(plan: HangPlan, gaps: Sequence[float]) -> str:
    """How :func:`hang_timeout` came about, for the hang line."""
    if plan.timeout_s is not None:
        return "--hang-timeout"
    if not gaps:
        return "the floor: no step interval seen yet"
    return f"max({plan.floor_s:g} s, {plan.factor:g} x the longest step, {max(gaps):.2f} s)"


@dataclass(frozen=True)
class Hang:
    """A hung worker: who, since when, and where it is."""

    rank: int
    local_rank: int
    pid: int
    step: int
    idle_s: float
    timeout_s: float
    stopped: bool
    where: str


def verdict(watch: Watch, workers: Sequence[Observed], now: float, plan: HangPlan) -> Hang | None:
    """The hung worker of this node, if any (module docstring), from the watch after :func:`observe`."""
    if not plan.enabled:
        return None
    timeout = hang_timeout(plan, watch.gaps)
    idle = {w.local_rank: now - watch.seen[w.local_rank].since for w in workers if _watched(watch, w)}
    stalled = [w for w in workers if idle.get(w.local_rank, 0.0) >= timeout and w.pid not in watch.stopped]
    culprits = [w for w in stalled if w.stopped or not _waiting(w)]
    if culprits:
        w = min(culprits, key=lambda w: (not w.stopped, _collectives(w), w.rank))
        return _hang(w, idle[w.local_rank], timeout, _where(w, workers))
    victims = [w for w in stalled if idle[w.local_rank] >= VICTIM_FACTOR * timeout]
    if victims:
        w = min(victims, key=lambda w: w.rank)
        return _hang(w, idle[w.local_rank], timeout, _where(w, workers))
    return None


def _watched(watch: Watch, w: Observed) -> bool:
    """From its first report; in a live round it entered, from its first step there (the module's rule)."""
    seen, rec = watch.seen.get(w.local_rank), w.record
    if seen is None or seen.pid != w.pid or rec is None or rec.beats == 0:
        return False
    return rec.rounds == 0 or rec.step_ns > 0


def _waiting(w: Observed) -> int:
    return w.record.waiting if w.record is not None else 0


def _collectives(w: Observed) -> int:
    return w.record.collectives if w.record is not None else 0


def _hang(w: Observed, idle: float, timeout: float, where: str) -> Hang:
    step = w.record.step if w.record is not None else 0
    return Hang(w.rank, w.local_rank, w.pid, step, idle, timeout, w.stopped, where)


def _where(w: Observed, workers: Sequence[Observed]) -> str:
    """Where the worker is, as far as its record (and its process state) tell."""
    n = _collectives(w)
    if w.stopped:
        return "stopped (SIGSTOP or a debugger): it cannot dump its stacks"
    if _waiting(w):
        others = [o.rank for o in workers if o.local_rank != w.local_rank and _collectives(o) < _waiting(w)]
        behind = f"local rank(s) {others} never entered it" if others else "no rank of this node is behind it"
        return f"waiting in engine collective #{_waiting(w)} ({behind}: the rank that did not enter it is elsewhere)"
    if w.record is not None and w.record.bounded:
        return (
            f"in a bounded wait of the live loop on work outside the engine's collectives (on its helper thread: a "
            f"checkpoint save's collectives, say), after its engine collective #{n}"
        )
    return f"outside the engine's collectives, after its collective #{n} (its peers wait for it)"
