"""``elasticzero-run --kill-job JOBID [--node-host HOST]``: stop every process of a job on this host.

The launcher backends run it on each node (over ssh, pdsh, srun, …) to clean up. It finds processes whose
environment holds ``ELASTICZERO_JOB_ID=JOBID`` (agents and workers; never by command line), SIGTERMs their
trees, and SIGKILLs what is left after the grace period; then removes the job's agent folders their dead agents left
on this host (:mod:`~elasticzero.agent.agentdirs`).

``--node-host HOST`` narrows it to one node of the job (the launcher's restart of a lost node, where another node of
the same job may share the machine or its process table): the agents started with ``--node-host HOST``, the
processes whose agent (``ELASTICZERO_AGENT_PID``) is one of them, and those whose agent is gone — a dead agent's
orphans (:func:`node_processes`, pure).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from elasticzero.agent.agentdirs import sweep
from elasticzero.agent.proctree import own_lineage, processes_with_env, terminate_trees
from elasticzero.proc import AGENT_PID_ENV, JOB_ID_ENV

NODE_HOST_FLAG = "--node-host"


@dataclass(frozen=True)
class JobProcess:
    """What :func:`node_processes` needs of one of the job's processes."""

    pid: int
    argv: tuple[str, ...]
    agent_pid: int | None  # ELASTICZERO_AGENT_PID: the agent that started it (None for an agent)


def node_host_of(argv: Sequence[str]) -> str | None:
    """The ``--node-host`` value in an agent's argv (``--node-host H`` or ``--node-host=H``), else None."""
    for i, arg in enumerate(argv):
        if arg == NODE_HOST_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(NODE_HOST_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def node_processes(procs: Sequence[JobProcess], host: str) -> list[int]:
    """The pids of node ``host``'s processes among the job's ``procs`` (see the module docstring)."""
    agents = {p.pid for p in procs if node_host_of(p.argv) == host}
    alive = {p.pid for p in procs}
    mine = [p for p in procs if p.pid in agents or (p.agent_pid is not None and p.agent_pid in agents)]
    orphans = [p for p in procs if p.agent_pid is not None and p.agent_pid not in alive]
    return sorted({p.pid for p in (*mine, *orphans)})


def _job_process(proc: psutil.Process) -> JobProcess | None:
    try:
        agent = proc.environ().get(AGENT_PID_ENV, "")
        return JobProcess(proc.pid, tuple(proc.cmdline()), int(agent) if agent.isdigit() else None)
    except (psutil.Error, OSError):
        return None


def kill_job(job_id: str, grace: float, node_host: str | None = None) -> int:
    """Terminate the job's processes on this host (only node ``node_host``'s, if given); return how many processes
    were signalled."""
    lineage = own_lineage()
    procs = processes_with_env(JOB_ID_ENV, job_id, exclude=lineage)
    if node_host is not None:
        seen = [j for p in procs if (j := _job_process(p)) is not None]
        keep = set(node_processes(seen, node_host))
        procs = [p for p in procs if p.pid in keep]
    return len(terminate_trees(procs, grace, exclude=lineage))


def main(job_id: str, grace: float, node_host: str | None = None) -> int:
    """CLI body: report the counts on stderr, exit 0 (also when nothing was found)."""
    n = kill_job(job_id, grace, node_host)
    folders = sweep(os.environ, job_id)
    line = f"kill-job {job_id}: signalled {n} process(es), removed {folders} folder(s)"
    print(f"elasticzero-run: {line}", file=sys.stderr)
    return 0
