"""``elasticzero-run --kill-job JOBID``: stop every process of a job on this host.

The launcher backends run it on each node (over ssh, pdsh, srun, …) to clean up. It finds processes whose
environment holds ``ELASTICZERO_JOB_ID=JOBID`` (agents and workers; never by command line), SIGTERMs their
trees, and SIGKILLs what is left after the grace period.
"""

from __future__ import annotations

import sys

from elasticzero.agent.proctree import own_lineage, processes_with_env, terminate_trees
from elasticzero.proc import JOB_ID_ENV


def kill_job(job_id: str, grace: float) -> int:
    """Terminate the job's processes on this host; return how many processes were signalled."""
    lineage = own_lineage()
    procs = processes_with_env(JOB_ID_ENV, job_id, exclude=lineage)
    return len(terminate_trees(procs, grace, exclude=lineage))


def main(job_id: str, grace: float) -> int:
    """CLI body: report the count on stderr, exit 0 (also when nothing was found)."""
    n = kill_job(job_id, grace)
    print(f"elasticzero-run: kill-job {job_id}: signalled {n} process(es)", file=sys.stderr)
    return 0
