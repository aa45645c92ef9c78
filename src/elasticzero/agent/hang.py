"""The agent's hang watch: thin I/O around :mod:`elasticzero.agent.progress` (which decides).

Each monitor tick (workers healthy) :meth:`HangWatch.look` reads the local workers' progress records and process
states and lets :func:`~elasticzero.agent.progress.verdict` decide (a fact of the tick, :mod:`elasticzero.agent.tick`);
on a hang :meth:`HangWatch.stop` prints one line (rank, step, where), has the worker dump its Python stacks into
its log (``faulthandler`` on :data:`~elasticzero.progress.STACKS_SIGNAL`; a stopped worker cannot), and SIGKILLs it.
torch's loop then sees a failed worker — a real failure: the restart is spent and the job restarts from its newest
checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time

import psutil
from torch.distributed.elastic.agent.server.api import WorkerGroup

from elasticzero.agent.agentdirs import make_private
from elasticzero.agent.progress import Hang, HangPlan, Observed, Watch, observe, stopping, timeout_source, verdict
from elasticzero.errors import UsageError
from elasticzero.progress import STACKS_SIGNAL, ProgressRecord, read_record

logger = logging.getLogger(__name__)

#: seconds between asking a hung worker for its stacks and killing it (faulthandler writes them in its handler)
DUMP_WAIT_S = 0.5
_STOPPED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


class HangWatch:
    """One agent's watch over its local workers' progress (see the module docstring)."""

    def __init__(self, plan: HangPlan) -> None:
        self.plan = plan
        self._watch = Watch()

    def start(self) -> None:
        """Before a round's workers start: a fresh watch, the records' directory, no record of the last round."""
        self._watch = Watch()
        if self.plan.progress_dir is None:
            return
        try:
            make_private(self.plan.progress_dir)  # a link there would have the loop below empty its target
            for name in os.listdir(self.plan.progress_dir):
                os.unlink(os.path.join(self.plan.progress_dir, name))
        except (OSError, UsageError) as exc:  # the workers then report nothing: no hang detection, training unaffected
            print(f"elasticzero-run: no progress records ({exc}); hang detection is off", file=sys.stderr, flush=True)

    def check(self, group: WorkerGroup) -> Hang | None:
        """:meth:`look`, then :meth:`stop` a hung worker (torch's loop sees it fail)."""
        hang = self.look(group)
        if hang is not None:
            self.stop(hang)
        return hang

    def look(self, group: WorkerGroup) -> Hang | None:
        """Read the records and process states, fold them into the watch, and return the verdict (nothing done)."""
        if not self.plan.enabled:
            return None
        now = time.monotonic()
        workers = [self._observed(w.global_rank, w.local_rank, w.id) for w in group.workers if w.id is not None]
        self._watch = observe(self._watch, workers, now)
        return verdict(self._watch, workers, now, self.plan)

    def records(self, group: WorkerGroup) -> list[ProgressRecord | None]:
        """The local workers' records as they are now (none without records: hang detection off)."""
        paths = [self.plan.record_file(w.local_rank) for w in group.workers]
        return [read_record(p) for p in paths if p is not None]

    def close(self) -> None:
        """Remove the records' directory (the agent is done)."""
        if self.plan.progress_dir is not None:
            shutil.rmtree(self.plan.progress_dir, ignore_errors=True)

    def _observed(self, rank: int, local_rank: int, pid: int) -> Observed:
        path = self.plan.record_file(local_rank)
        record = read_record(path) if path is not None else None
        return Observed(rank, local_rank, int(pid), record, _stopped(int(pid)))

    def stop(self, hang: Hang) -> None:
        """The hang line, the worker's stacks (unless it is stopped), then SIGKILL."""
        stacks = "none: a stopped process cannot dump them" if hang.stopped else "in its log (its stderr)"
        line = (
            f"hang: rank {hang.rank} (local rank {hang.local_rank}, pid {hang.pid}) made no progress for "
            f"{hang.idle_s:.1f}s after step {hang.step} (hang timeout {hang.timeout_s:.1f}s: "
            f"{timeout_source(self.plan, self._watch.gaps)}); where: {hang.where}; Python stacks: {stacks}; "
            "stopping it: the job restarts from its newest checkpoint (a restart spent)"
        )
        logger.info(line)
        print(f"elasticzero-run: {line}", file=sys.stderr, flush=True)
        if not hang.stopped:
            _signal(hang.pid, STACKS_SIGNAL)
            time.sleep(DUMP_WAIT_S)
        _signal(hang.pid, signal.SIGKILL)
        self._watch = stopping(self._watch, hang.pid)


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in _STOPPED
    except psutil.Error:
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
