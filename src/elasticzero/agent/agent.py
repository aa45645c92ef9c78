"""``ElasticZeroAgent``: torch's ``LocalElasticAgent`` with tree kill, root-cause reporting and a health file.

Only the hooks torch's run loop (``SimpleElasticAgent._invoke_run``) calls are overridden — protected methods, not a
public API; ``tests/unit/agent/test_exit_barrier.py`` checks torch still calls ``_exit_barrier`` there:

* ``_set_local_rank_env`` — torch's (``LOCAL_RANK``), then what the agent was built with for that local rank
  (``worker_env``: job id, agent pid, devices, cores; see :meth:`~elasticzero.agent.plan.WorkersPlan.worker_env`):
  the workers' environment is handed over where torch builds it, never through the agent's ``os.environ``;
* ``_rendezvous`` — torch's; with ``--live-recovery`` (:mod:`~elasticzero.agent.handoff`) then this node's round file
  for the round just formed (the round number agreed with the other agents over the round's store), before any
  worker starts or is handed the round;
* ``_start_workers`` — a fresh hang watch (:mod:`elasticzero.agent.hang`), torch's, then the health file says
  ``running`` with this round's ranks and pids;
* ``_monitor_workers`` / ``_restart_workers`` — each tick is a decision (:mod:`~elasticzero.agent.tick`): the
  override gathers the tick's facts into one :class:`~elasticzero.agent.tick.Facts` (torch's verdict on the workers;
  after a failure the round's marks; while healthy the peer verdict of :mod:`~elasticzero.agent.peers` first, then
  the closed flag and the job-failed mark, the hang verdict of :mod:`~elasticzero.agent.hang`; torch's restart hook
  with healthy workers: nodes waiting to join), calls :func:`~elasticzero.agent.tick.decide` and carries out its
  one action: report a real failure (torch's loop spends a restart), re-join a round being changed for free, stop
  (a silent c10d store, a job marked failed, a rendezvous closed by another node), a membership change (peer lost,
  peer waiting to join, this node dropped: marked in the round's store (:data:`ROUND_CHANGE_KEY`) first where the
  others must hear of it, then with ``--live-recovery`` a hand-off around the running workers
  (:meth:`ElasticZeroAgent._hand_off`), else a re-formed round; no restart spent), or kill a hung worker (its stacks
  first; the next tick sees it fail, a real failure); in live mode also a failed collective's ask
  (:mod:`~elasticzero.agent.suspicion`): ask the round's nodes, answer another's ask, drop the silent ones;
* ``_invoke_run`` — before this node leaves on a signal (the others going on), it marks the round as changing, so a
  peer whose workers die of it does not count a failure;
* ``_exit_barrier`` — torch's terminal-state barrier (same keys, same success condition), polled: a node whose
  workers succeeded stops waiting as soon as another node marks the job failed (:meth:`announce_failure`) or
  closes the rendezvous without completing the barrier, and fails instead of sitting out ``exit_barrier_timeout``;
* ``_stop_workers`` / ``_shutdown`` — torch's graceful stop (SIGTERM to each worker's process group, SIGKILL
  after the grace), followed by a psutil sweep that SIGKILLs every process still carrying this agent's
  ``ELASTICZERO_AGENT_PID`` or descending from a worker, so grandchildren that left the process group die too.

Worker-side safety (parent-death signal, core binding, DeepSpeed's env) is applied by the exec shim the launch
function wraps around the command; see :mod:`elasticzero.agent.shim`.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    _TERMINAL_STATE_SYNC_ID,
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from elasticzero.agent.binding import AGENT_PID_ENV
from elasticzero.agent.handoff import (
    LivePlan,
    RoundAgreementError,
    RoundFacts,
    RoundKeeper,
    handoff_line,
    retry_agreement,
)
from elasticzero.agent.hang import HangWatch
from elasticzero.agent.health import HealthFile
from elasticzero.agent.liveness import Liveness, PeerPlan
from elasticzero.agent.peers import PeerWatch, StoreLostError, bounded_call, drop_nodes
from elasticzero.agent.proctree import descendants, kill_now, processes_with_env
from elasticzero.agent.progress import NO_HANG, HangPlan
from elasticzero.agent.prompt import expect
from elasticzero.agent.stopsignals import StopSignals
from elasticzero.agent.suspicion import ask_line, reported
from elasticzero.agent.tick import (
    Action,
    AskPeers,
    Continue,
    Facts,
    Halt,
    HandOff,
    KillHung,
    Reform,
    Rejoin,
    ReportFailure,
    RoundView,
    Stop,
    Suspicion,
    Workers,
    decide,
    leaving_is_membership_change,
    rejoin_line,
)
from elasticzero.torchcompat import DEFAULT_SHUTDOWN_TIMEOUT, agent_shutdown_kwargs, stop_kwargs

logger = logging.getLogger(__name__)

#: round-scoped store key (the rendezvous store is prefixed per round) a node sets when its restarts are exhausted;
#: the value is its root-cause line
JOB_FAILED_KEY = "elasticzero/agent/job_failed"
#: counter of nodes that know the job failed (the failing ones and those that saw the key)
FAILED_SEEN_KEY = "elasticzero/agent/job_failed_seen"
#: set by the last node to count itself in FAILED_SEEN_KEY
ALL_SEEN_KEY = "elasticzero/agent/job_failed_all_seen"
#: how long a failing node waits, at most, for the others to see its failure before it exits (it may host the store)
FAILURE_LINGER_S = 10.0
#: poll period of the exit barrier
EXIT_BARRIER_POLL_S = 0.25
#: counter of nodes that saw the exit barrier complete, and how long a node waits for the others to see it
BARRIER_SEEN_KEY = "elasticzero/agent/exit_barrier_seen"
EXIT_LINGER_S = 5.0
#: round-scoped key a node sets just before it stops its workers for a membership change (a node waiting to join,
#: or this node leaving on a signal while enough nodes remain); value: ``node <group rank>: <why>``
ROUND_CHANGE_KEY = "elasticzero/agent/round_changing"


class PeerFailedError(RendezvousClosedError):
    """Another node of this job failed (restarts exhausted) or closed the run: this node must fail too."""


class ElasticZeroAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that leaves no process behind and says which rank failed first."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        health_file: str | None = None,
        min_nodes: int = 1,
        monitor_hold_file: str | None = None,
        worker_env: Callable[[int], Mapping[str, str]] | None = None,
        shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT,
        hang: HangPlan | None = None,
        peers: PeerPlan | None = None,
        live: LivePlan | None = None,
        stop_signals: StopSignals | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, logs_specs, **kwargs, **agent_shutdown_kwargs(shutdown_timeout))
        self._stop_grace = shutdown_timeout
        self._worker_env = worker_env
        self._health = HealthFile(health_file)
        self._min_nodes = min_nodes
        self._monitor_hold_file = monitor_hold_file
        self._worker_pids: list[int] = []
        self._hang = HangWatch(hang or NO_HANG)
        self._peer_plan = peers
        self._peers: PeerWatch | None = None  #: watches the current round's participants (peer liveness)
        self._rounds = RoundKeeper(live) if live is not None else None  #: live recovery: this node's round file
        self.last_failure: tuple[int, ProcessFailure] | None = None
        self._stop_signals = stop_signals  #: the stop-signal handler torch's worker start replaces (stopsignals.py)
        self.joined = False  #: a rendezvous completed with this node (a store lost after it: this node is cut off)

    def remove_health_file(self) -> None:
        """Delete the health file and the workers' progress records (called once the agent is done)."""
        self._health.remove()
        self._hang.close()
        if self._rounds is not None:
            self._rounds.remove()

    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        """torch's ``LOCAL_RANK`` (and virtual-rank devices), then ours for ``local_rank`` (ours win).

        With ``--virtual-local-rank`` torch maps the rank through the *agent's* ``CUDA_VISIBLE_DEVICES``; when ours
        names the node's devices, torch's mapping is not asked (it would fail or disagree): ``LOCAL_RANK`` is 0, as
        torch sets it in that mode, and the device is ours.
        """
        extra = self._worker_env(local_rank) if self._worker_env is not None else {}
        if spec.virtual_local_rank and "CUDA_VISIBLE_DEVICES" in extra:
            worker_env["LOCAL_RANK"] = "0"
        else:
            super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env.update(extra)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous; in live mode, then this node's round file for the round just formed (every start).

        A node lost between the rendezvous and the round-number agreement fails the agreement on every node alike:
        each rendezvouses again (:func:`~elasticzero.agent.handoff.retry_agreement`), and the next round drops it.
        """
        tries = 0
        while True:
            super()._rendezvous(worker_group)
            self.joined = True
            if self._rounds is None:
                return
            tries += 1
            try:
                self._rounds.publish(self._store, round_facts(worker_group))
                return
            except RoundAgreementError as exc:
                if not retry_agreement(tries):
                    raise
                print(f"elasticzero-run: {exc}; joining the rendezvous again", file=sys.stderr, flush=True)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._hang.start()
        pids = super()._start_workers(worker_group)
        if self._stop_signals is not None:
            self._stop_signals.reinstall()  # torch's process context just installed its own handler
        self._worker_pids = [int(p) for p in pids.values()]
        self._watch_round(worker_group)
        return pids

    def _watch_round(self, worker_group: WorkerGroup) -> None:
        """A peer watch over the round just formed, and the health file: this round's ranks, the running pids."""
        if self._peer_plan is not None:
            store = self._store if self._rounds is not None else None  # live mode: a failed collective's asks
            spec = worker_group.spec
            self._peers = PeerWatch.for_round(spec.rdzv_handler, self._peer_plan, store, spec.monitor_interval)
        self._health.write(
            "running",
            worker_pids=self._worker_pids,
            ranks=[w.global_rank for w in worker_group.workers],
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
            restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
        )

    def _hand_off(self, worker_group: WorkerGroup, why: str) -> None:
        """Live recovery: re-rendezvous around the running workers and write them the new round (no restart).

        torch's ``_rendezvous`` replaces the group's workers (new ranks); they are the same processes, so each keeps
        its id (torch's monitor compares the group's ids with its process context's pids). The hang watch goes on
        as it is: its records are per local rank and pid (a fresh one would unlink the files the workers write).
        """
        ids = {w.local_rank: w.id for w in worker_group.workers}
        self._peers = None
        self._rendezvous(worker_group)
        for w in worker_group.workers:
            w.id = ids.get(w.local_rank)
        self._watch_round(worker_group)
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        number = self._rounds.last if self._rounds is not None else None
        print(handoff_line(number, world, why), file=sys.stderr, flush=True)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's monitor; then this tick's facts, :func:`~elasticzero.agent.tick.decide`, its action."""
        self._hold_for_test()
        if self._stop_signals is not None:
            self._stop_signals.raise_if_lost()
        result = super()._monitor_workers(worker_group)
        return self._carry_out(decide(self._tick_facts(worker_group, result)), worker_group, result)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch's loop sets the group's state before it restarts: HEALTHY only when nodes wait to join (a change:
        decided as a tick's); otherwise a real failure, whose restart torch's loop has spent."""
        if worker_group.state != WorkerState.HEALTHY:
            super()._restart_workers(worker_group)
            return
        facts = Facts(Workers.HEALTHY, self._rounds is not None, self._remaining_restarts, nodes_waiting=True)
        self._carry_out(decide(facts), worker_group, RunResult(state=WorkerState.HEALTHY))

    def _tick_facts(self, worker_group: WorkerGroup, result: RunResult) -> Facts:
        """What this tick knows, read in an order that never blocks on a silent store: torch's verdict on the workers;
        after a failure the round's marks; while healthy the peer verdict first (bounded: the store calls after it
        find the store answering), then — unless the store was found silent — the closed flag and the job-failed
        mark (:meth:`_closed`), the change mark where a peer is lost (a leaver marked it), and the hang verdict."""
        live, remaining = self._rounds is not None, self._remaining_restarts
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            return Facts(Workers.FAILED, live, remaining, marks=self._round_view())
        if result.state != WorkerState.HEALTHY:
            return Facts(Workers.OTHER, live, remaining)
        peers = self._peers
        liveness = peers.check() if peers is not None else Liveness()
        plan = peers.plan if peers is not None else None
        if liveness.store_silent_s is not None:
            return Facts(Workers.HEALTHY, live, remaining, liveness=liveness, peers=plan)
        closed, job_failed = self._closed(worker_group)
        lost = bool(liveness.gone) and not liveness.self_gone and not closed
        suspicion = self._suspicion(worker_group)
        # did a leaver announce the change? (a lost peer's, or a failed collective's: a peer's hand-off closes it)
        changing = self._change_mark() if lost or (suspicion.reported and suspicion.asker is None) else None
        marks, hang = RoundView(changing, job_failed), self._hang.look(worker_group)
        return Facts(
            Workers.HEALTHY, live, remaining, marks, liveness=liveness, closed=closed, hang=hang, peers=plan,
            suspicion=suspicion,
        )  # fmt: skip

    def _suspicion(self, worker_group: WorkerGroup) -> Suspicion:
        """Live mode: whether a local worker's collective failed in the current round, and the round's ask."""
        if self._rounds is None or self._peers is None:
            return Suspicion()
        return self._peers.suspicion(reported(self._hang.records(worker_group), self._rounds.last))

    def _closed(self, worker_group: WorkerGroup) -> tuple[bool, str | None]:
        """Whether another node closed the rendezvous (it gave up: restarts exhausted), and the job-failed mark.

        torch's loop only looks at the wait list, so workers that never talk to that node would run on alone. With
        peer liveness the closed flag comes from its read (bounded; the failing node marks the job failed before it
        closes) and the mark is read only once closed, so a healthy tick makes no store call of its own that a lost
        c10d store could block. Without, both are read every tick.
        """
        closed = self._peers.closed if self._peers is not None else None
        if closed is None:
            return bool(worker_group.spec.rdzv_handler.is_closed()), self._job_failed_mark()
        return closed, (self._job_failed_mark() if closed else None)

    def _change_mark(self) -> str | None:
        """The round's change mark (read after a peer-liveness verdict found the store answering; an error: none)."""
        try:
            return _get_if_set(self._store, ROUND_CHANGE_KEY) if self._store is not None else None
        except Exception as exc:
            logger.info("could not read the round's change mark: %s", exc)
            return None

    def _job_failed_mark(self) -> str | None:
        return _get_if_set(self._store, JOB_FAILED_KEY) if self._store is not None else None

    def _carry_out(self, action: Action, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """Do what :func:`~elasticzero.agent.tick.decide` chose; the result torch's loop goes on with."""
        match action:
            case Continue():
                return result
            case ReportFailure():
                self.last_failure = root_cause(result.failures)
                report_failure(*self.last_failure)
                return result
            case Rejoin(why=why):
                return self._rejoin(worker_group, why, root_cause(result.failures))
            case Stop():
                raise self._stop_error(action)
            case KillHung(hang=hang):
                self._hang.stop(hang)
                return result
            case AskPeers():
                self._ask()
                return result
            case HandOff() | Reform():
                self._change_round(action, worker_group)
                return RunResult(state=WorkerState.HEALTHY)

    def _ask(self) -> None:
        """Ask the round's nodes whether they are alive (a local worker's collective failed); bounded by the peer
        timeout — a store that does not answer is left to the peer watch (its silence is found there)."""
        peers = self._peers
        if peers is None:
            return
        try:
            asker = bounded_call(peers.ask, peers.plan.timeout_s, _store_silent)
        except Exception as exc:
            logger.warning("could not ask the round's nodes after a failed collective: %s", exc)
            return
        if asker == peers.this_node:
            print(f"elasticzero-run: {ask_line(peers.round_nodes)}", file=sys.stderr, flush=True)

    def _settle_ask(self, action: HandOff) -> None:
        """Before a hand-off on an ask: this node's answer, or the silent nodes dropped from the rendezvous."""
        peers = self._peers
        if peers is None:
            return
        try:
            if action.answer:
                bounded_call(peers.answer, peers.plan.timeout_s, _store_silent)
            if action.drop:
                handler = self._worker_group.spec.rdzv_handler
                drop = functools.partial(drop_nodes, handler, action.drop, peers.this_node)
                bounded_call(drop, peers.plan.timeout_s, _store_silent)
        except Exception as exc:  # the heartbeats still drop a dead node, at the peer timeout
            logger.warning("could not settle the ask in the rendezvous store: %s", exc)

    def _change_round(self, action: HandOff | Reform, worker_group: WorkerGroup) -> None:
        """A membership change: the mark first (the others' workers may die of it), then the hand-off or re-form."""
        if action.mark is not None:
            self._mark_round_changing(action.mark)
        if isinstance(action, HandOff):
            self._settle_ask(action)
            if self._peers is not None:  # the round's nodes still alive: the prompt rendezvous waits for them only
                expect(worker_group.spec.rdzv_handler, self._peers.alive(action.drop))
            self._hand_off(worker_group, action.why)
            return
        print(f"elasticzero-run: {action.line}", file=sys.stderr, flush=True)
        self._peers = None
        super()._restart_workers(worker_group)  # not ours: the change is decided

    def _stop_error(self, action: Stop) -> Exception:
        """The error a :class:`~elasticzero.agent.tick.Stop` raises (a node that learned the job failed counts in)."""
        if action.halt is Halt.STORE_LOST:
            return StoreLostError(action.line)
        if action.halt is Halt.JOB_FAILED:
            self._count_failure_seen()
        return PeerFailedError(action.line)

    def _rejoin(self, worker_group: WorkerGroup, why: str, failure: tuple[int, ProcessFailure]) -> RunResult:
        """Restart the workers through a new rendezvous without spending a restart (the round is changing)."""
        msg = rejoin_line(why, describe_failure(*failure))
        logger.warning(msg)
        print(f"elasticzero-run: {msg}", file=sys.stderr, flush=True)
        self.last_failure = None
        super()._restart_workers(worker_group)  # not ours: this node is not the one changing the round
        return RunResult(state=WorkerState.HEALTHY)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as exc:  # torch's run() stops the workers next: mark first, if the others go on
            group = self._worker_group
            if group.group_world_size and leaving_is_membership_change(group.group_world_size, self._min_nodes):
                self._mark_round_changing(f"leaving on {exc.sigval.name}")
            raise

    def _mark_round_changing(self, why: str) -> None:
        """Set :data:`ROUND_CHANGE_KEY` in this round's store (before this node's workers are stopped)."""
        store = self._store
        if store is None:
            return
        try:
            store.set(ROUND_CHANGE_KEY, f"node {self._worker_group.group_rank}: {why}")
        except Exception as exc:  # the store's host is gone: the peers' workers fail on their own anyway
            logger.warning("could not mark the round as changing: %s", exc)

    def _round_view(self) -> RoundView:
        """Read the round's change and job-failed marks (a store error reads as no mark: a real failure)."""
        store = self._store
        if store is None:
            return RoundView()
        try:
            return RoundView(
                changing=_get_if_set(store, ROUND_CHANGE_KEY), job_failed=_get_if_set(store, JOB_FAILED_KEY)
            )
        except Exception as exc:
            logger.info("could not read the round's marks after a worker failure: %s", exc)
            return RoundView()

    def _hold_for_test(self) -> None:
        """Test hook (:data:`~elasticzero.agent.plan.MONITOR_HOLD_ENV`): wait while the hold file exists."""
        path = self._monitor_hold_file
        if not path or not os.path.exists(path):
            return
        with open(f"{path}.held", "w"):
            pass
        while os.path.exists(path):
            time.sleep(0.05)

    def _raise_if_peer_failed(self) -> None:
        """Raise :class:`PeerFailedError` (after counting this node as informed) if the job is marked failed."""
        store = self._store
        if store is None or not store.check([JOB_FAILED_KEY]):
            return
        cause = store.get(JOB_FAILED_KEY).decode(errors="replace")
        self._count_failure_seen()
        raise PeerFailedError(f"the rendezvous was closed by another node, whose workers failed: {cause}")

    def _exit_barrier(self) -> None:
        """torch's exit barrier (same keys and timeout), polled so a failure elsewhere ends it within a poll.

        This node's workers succeeded. It checks in as torch does, then every ``EXIT_BARRIER_POLL_S`` looks at
        (``store.check``, which logs nothing): the job-failed key (→ :class:`PeerFailedError`); the barrier's
        last-member key (→ done, after :meth:`_linger_after_barrier`); whether the rendezvous is closed while the
        barrier is incomplete (→ :class:`PeerFailedError`; a node that leaves without reaching the barrier, e.g. a
        rendezvous error after a failed restart, closes it — after a success the others close it too, hence the
        last-member key is read again first). Store errors end the wait as in torch (logged; still a success).
        """
        group = self._worker_group
        logger.info("local worker group finished; waiting up to %ss for the other nodes", self._exit_barrier_timeout)
        start = time.monotonic()
        self._in_exit_barrier = True
        try:
            store = self._store
            if store is None:
                return
            # torch's own check-in (counter + last-member key), so the success condition is torch's
            last_key = _barrier_nonblocking(store, group.group_world_size, _TERMINAL_STATE_SYNC_ID)
            while time.monotonic() - start < self._exit_barrier_timeout:
                self._raise_if_peer_failed()
                if store.check([last_key]):
                    self._raise_if_peer_failed()  # a failing node marks the job before it could complete us
                    logger.info("done waiting for the other nodes after %.1fs", time.monotonic() - start)
                    self._linger_after_barrier(group.group_world_size)
                    return
                if group.spec.rdzv_handler.is_closed() and not store.check([last_key]):
                    self._raise_if_peer_failed()
                    raise PeerFailedError("another node closed the rendezvous before finishing; the job failed")
                time.sleep(EXIT_BARRIER_POLL_S)
            logger.error("timed out after %ss waiting for the other nodes to finish", self._exit_barrier_timeout)
        except (PeerFailedError, SignalException):
            raise
        except Exception as exc:
            logger.warning("exit barrier ended by a store error after %.1fs: %s", time.monotonic() - start, exc)
        finally:
            self._in_exit_barrier = False

    def _linger_after_barrier(self, world: int) -> None:
        """Stay until every node saw the barrier complete (at most ``EXIT_LINGER_S``).

        torch's barrier is a blocking wait, so the store pushes the completion to everyone before the node hosting
        the store can leave; a polling node could find the store gone instead. So each node counts itself as
        having seen the completion and waits for the others; a store error here is harmless (all saw it).
        """
        store = self._store
        if store is None:
            return
        deadline = time.monotonic() + EXIT_LINGER_S
        try:
            store.add(BARRIER_SEEN_KEY, 1)
            while store.add(BARRIER_SEEN_KEY, 0) < world and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception as exc:
            logger.debug("store gone after the exit barrier completed: %s", exc)

    def announce_failure(self, result: RunResult) -> None:
        """Mark the job failed in this round's store (value: the root-cause line), so the other nodes stop now."""
        store = self._store
        if store is None:
            return
        line = describe_failure(*root_cause(result.failures)) if result.failures else "workers failed"
        group_rank = self._worker_group.group_rank
        try:
            store.set(JOB_FAILED_KEY, f"node {group_rank}: {line}")
            self._count_failure_seen()
        except Exception:
            logger.exception("could not mark the job failed in the rendezvous store")

    def _count_failure_seen(self) -> None:
        """Count this node as knowing the job failed; the last one sets :data:`ALL_SEEN_KEY`."""
        store = self._store
        if store is not None and store.add(FAILED_SEEN_KEY, 1) >= (self._worker_group.group_world_size or 1):
            store.set(ALL_SEEN_KEY, "1")

    def await_peers_informed(self, timeout: float = FAILURE_LINGER_S) -> float:
        """After :meth:`announce_failure`: wait (at most ``timeout`` s) until every node of the round saw it.

        This node may host the embedded store; leaving at once could take the failure key with it. One blocking
        store wait (the store pushes the key to us, so a peer that hosts the store and leaves right after is no
        problem). Returns the seconds waited.
        """
        store = self._store
        start = time.monotonic()
        if store is None:
            return 0.0
        try:
            store.wait([ALL_SEEN_KEY], timedelta(seconds=timeout))
        except Exception as exc:  # timed out (a node never looked), or the store's host left / died
            logger.info("stopped waiting for the other nodes to see the failure: %s", exc)
        return time.monotonic() - start

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=self._stop_grace)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        tree = descendants(self._worker_pids)
        super()._shutdown(death_sig, **stop_kwargs(timeout))
        leftovers = [p for p in tree if p.is_running()]
        leftovers += processes_with_env(AGENT_PID_ENV, str(os.getpid()), exclude=(os.getpid(),))
        if leftovers:
            logger.warning("killing %d leftover worker process(es): %s", len(leftovers), [p.pid for p in leftovers])
            kill_now(leftovers)
        self._worker_pids = []
        self._health.write("stopped")


def _store_silent(waited_s: float) -> TimeoutError:
    return TimeoutError(f"the rendezvous store did not answer within {waited_s:.1f} s")


def round_facts(worker_group: WorkerGroup) -> RoundFacts:
    """What the rendezvous just completed gave this node, as plain values (:mod:`~elasticzero.agent.handoff`)."""
    workers = worker_group.workers
    return RoundFacts(
        ranks=tuple((w.local_rank, w.global_rank) for w in workers),
        world_size=workers[0].world_size if workers else 0,
        master_addr=str(worker_group.master_addr),
        master_port=int(worker_group.master_port or 0),
        agent_store=bool(worker_group.spec.rdzv_handler.use_agent_store),
        group_rank=worker_group.group_rank or 0,
        group_world_size=worker_group.group_world_size or 1,
    )


def _get_if_set(store: Any, key: str) -> str | None:
    """``store.get(key)`` decoded, or ``None`` when the key is not set (``check`` does not block)."""
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The global rank that failed first, and its failure.

    Ordered by torch's failure timestamp (from the error file, else the time the agent saw the exit — whole
    seconds), then collateral last: torch's process context SIGTERMs the other local workers as soon as one fails
    and reports them as failures too, so a SIGTERM exit without an error file loses a tie. Then by rank.
    """

    def key(rank: int) -> tuple[int, bool, int]:
        f = failures[rank]
        collateral = f.exitcode == -signal.SIGTERM and not os.path.isfile(f.error_file)
        return f.timestamp, collateral, rank

    rank = min(failures, key=key)
    return rank, failures[rank]


def describe_failure(rank: int, failure: ProcessFailure) -> str:
    """One line naming the root-cause rank, its exit, and its error file."""
    code = failure.exitcode
    how = f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"
    has_file = os.path.isfile(failure.error_file)
    error_file = failure.error_file if has_file else "none (the worker did not use torch's @record)"
    who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    line = f"root cause: {who} {how}; error file: {error_file}"
    if has_file:
        msg = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        line += f"; message: {' '.join(str(msg).split())[:300]}"
    return line


def report_failure(rank: int, failure: ProcessFailure) -> None:
    """Print the root cause on the agent's stderr (and the log)."""
    line = describe_failure(rank, failure)
    logger.error(line)
    print(f"elasticzero-run: {line}", file=sys.stderr, flush=True)
