"""``ElasticZeroAgent``: torch's ``LocalElasticAgent`` with tree kill, root-cause reporting and a health file.

Only the public hooks are overridden:

* ``_start_workers`` — torch's, then the health file says ``running`` with this round's ranks and pids;
* ``_monitor_workers`` — torch's; on a failure, the root-cause rank and its error file are reported once; while
  healthy, a rendezvous closed by another node (it exhausted its restarts) stops this node too;
* ``_stop_workers`` / ``_shutdown`` — torch's graceful stop (SIGTERM to each worker's process group, SIGKILL
  after the grace), followed by a psutil sweep that SIGKILLs every process still carrying this agent's
  ``ELASTICZERO_AGENT_PID`` or descending from a worker, so grandchildren that left the process group die too.

Worker-side safety (parent-death signal, core binding, DeepSpeed's env) is applied by the exec shim the launch
function wraps around the command; see :mod:`elasticzero.agent.shim`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elasticzero.agent.binding import AGENT_PID_ENV
from elasticzero.agent.health import HealthFile
from elasticzero.agent.proctree import descendants, kill_now, processes_with_env

logger = logging.getLogger(__name__)


class ElasticZeroAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that leaves no process behind and says which rank failed first."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        health_file: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, logs_specs, **kwargs)
        self._health = HealthFile(health_file)
        self._worker_pids: list[int] = []
        self.last_failure: tuple[int, ProcessFailure] | None = None

    def remove_health_file(self) -> None:
        """Delete the health file (called once the agent is done)."""
        self._health.remove()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        self._worker_pids = [int(p) for p in pids.values()]
        self._health.write(
            "running",
            worker_pids=self._worker_pids,
            ranks=[w.global_rank for w in worker_group.workers],
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
            restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
        )
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            self.last_failure = root_cause(result.failures)
            report_failure(*self.last_failure)
        elif result.state == WorkerState.HEALTHY and worker_group.spec.rdzv_handler.is_closed():
            # another node gave up (restarts exhausted) and closed the run; torch's loop only looks at the wait
            # list, so workers that never talk to that node would run on alone. Stop them and exit.
            raise RendezvousClosedError("the rendezvous was closed by another node; stopping this node's workers")
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=self._shutdown_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        tree = descendants(self._worker_pids)
        super()._shutdown(death_sig, timeout)
        leftovers = [p for p in tree if p.is_running()]
        leftovers += processes_with_env(AGENT_PID_ENV, str(os.getpid()), exclude=(os.getpid(),))
        if leftovers:
            logger.warning("killing %d leftover worker process(es): %s", len(leftovers), [p.pid for p in leftovers])
            kill_now(leftovers)
        self._worker_pids = []
        self._health.write("stopped")


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
