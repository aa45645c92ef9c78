"""``elasticzero-run --kill-job JOBID``: stop every process of a job on this host.

The launcher backends run it on each node (over ssh, pdsh, srun, …) to clean up. It finds processes whose
environment holds ``ELASTICZERO_JOB_ID=JOBID`` (agents and workers; never by command line), SIGTERMs their
trees, and SIGKILLs what is left after the grace period; then removes the job's agent folders their dead agents left
on this host (:mod:`~elasticzero.agent.agentdirs`).
"""

from __future__ import annotations

import os
import sys

from elasticzero.agent.agentdirs import sweep
from elasticzero.agent.proctree import own_lineage, processes_with_env, terminate_trees
from elasticzero.proc import JOB_ID_ENV


def kill_job(job_id: str, grace: float) -> int:
    """Terminate the job's processes on this host; return how many processes were signalled."""
    lineage = own_lineage()
    procs = processes_with_env(JOB_ID_ENV, job_id, exclude=lineage)
    return len(terminate_trees(procs, grace, exclude=lineage))


def main(job_id: str, grace: float) -> int:
    """CLI body: report the counts on stderr, exit 0 (also when nothing was found)."""
    n = kill_job(job_id, grace)
    folders = sweep(os.environ, job_id)
    line = f"kill-job {job_id}: signalled {n} process(es), removed {folders} folder(s)"
    print(f"elasticzero-run: {line}", file=sys.stderr)
    return 0
