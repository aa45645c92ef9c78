"""Exec shim run as each worker process before the user's program (see :func:`~elasticzero.agent.binding.shim_argv`).

Inside the worker it (1) asks the kernel to SIGKILL it when the agent dies (``PR_SET_PDEATHSIG``, which
survives ``execve``) and exits if the agent is already gone, (2) binds the process to its cores when
``--bind-cores-to-rank`` is on, (3) adds DeepSpeed's extra variables, then ``execvp``s the real command so the
worker keeps this pid. Imports nothing heavy: it costs one small interpreter start per worker.
"""

from __future__ import annotations

import os
import signal
import sys

from elasticzero.agent.binding import AGENT_PID_ENV, cores_for_worker, worker_extra_env
from elasticzero.proc import arm_parent_death_signal


def main(argv: list[str]) -> int:
    """Apply the worker-side settings and exec ``argv`` (after ``--``)."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("elasticzero.agent.shim: usage: shim -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    agent_pid = os.environ.get(AGENT_PID_ENV)
    arm_parent_death_signal(signal.SIGKILL)
    if agent_pid and os.getppid() != int(agent_pid):
        return 1  # the agent died before the death signal was armed: do not become an orphan
    cores = cores_for_worker(os.environ)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    os.environ.update(worker_extra_env(os.environ))
    os.execvp(argv[0], argv)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
