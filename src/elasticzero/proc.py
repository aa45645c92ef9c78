"""Process rules, one home each: the parent-death signal, the exit code of a signalled process, the job id.

* **Parent-death signal.** A child started by the launcher, the per-rank wrapper or the agent asks the kernel (Linux
  ``prctl(PR_SET_PDEATHSIG)``) for a signal when its parent dies, so no process outlives the one that owns it.
  :func:`parent_death_preexec` is the ``preexec_fn`` form (the parent forks and the child arms itself, then exits
  if the parent is already gone); :func:`arm_parent_death_signal` arms the calling process (the agent's exec shim,
  whose setting survives ``execve``).
* **Exit codes.** A process killed by signal N exits ``128+N``, as a shell reports it (:func:`signal_exit_code`,
  :func:`exit_status` for ``Popen``/torch return codes, which are ``-N``).
* **Stop signals.** The signals that stop a job everywhere (:data:`STOP_SIGNALS`): the launcher forwards them to
  its commands, and the agent exits on them while it starts.
* **Leaving with threads left behind.** A process whose daemon threads may still sit in a C++ call it gave up on (a
  store call on a store out of reach) ends with :func:`leave_now`, not the interpreter's finalization
  (:func:`leave_if_threads_left`): CPython before 3.14 ends a daemon thread that takes the GIL back during
  finalization with ``pthread_exit``, and its forced unwind through a C++ ``noexcept`` frame (torch's binding
  re-acquiring the GIL as the call returns) is ``std::terminate`` — SIGABRT, whatever the exit status was.
* **Job id.** Every process of a job carries ``ELASTICZERO_JOB_ID=<id>`` (:data:`JOB_ID_ENV`); cleanup
  (``elasticzero-run --kill-job``) is scoped by it. :func:`check_job_id` is the one rule for a valid id.

Standard library only: the exec shim imports this before every worker's program starts.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from elasticzero.errors import UsageError

#: environment variable naming the job of every process elasticzero starts (agents, workers, per-rank wrappers)
JOB_ID_ENV = "ELASTICZERO_JOB_ID"
#: the pid of the ``elasticzero-run`` agent that started this worker (one agent per node, for the node's life)
AGENT_PID_ENV = "ELASTICZERO_AGENT_PID"
#: a job id: safe as an etcd key part, an environment value and a remote-shell word without quoting surprises
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
JOB_ID_RULE = "letters, digits, '.', '_', '-', starting with a letter or digit, at most 128 characters"

#: signals that stop the job everywhere (SIGHUP: the terminal was closed): the launcher's and torch's stop signals
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

#: ``prctl`` option: the signal this process gets when its parent (thread) dies
PR_SET_PDEATHSIG = 1


def check_job_id(job_id: str, source: str) -> str:
    """``job_id`` if it is valid, else :class:`UsageError` naming ``source`` (a flag or file) and the rule."""
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise UsageError(f"{source} {job_id!r}: use {JOB_ID_RULE} in a job id")
    return job_id


def signal_exit_code(signum: int) -> int:
    """The exit code of a process stopped by ``signum``, as a shell reports it: ``128+signum``."""
    return 128 + int(signum)


def exit_signal(code: int) -> int | None:
    """The signal N of an exit code ``128+N`` (N a real signal number, 1..64), else ``None``."""
    return code - 128 if 128 < code <= 128 + 64 else None


def exit_status(returncode: int) -> int:
    """A ``Popen``/torch return code (``-N`` for death by signal N) as an exit code: ``128+N``, else unchanged."""
    return signal_exit_code(-returncode) if returncode < 0 else returncode


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or ``None`` where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def arm_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies; ``False`` where unsupported.

    The caller checks afterwards that its parent is still the one it expects: a parent that died before the call
    never sends the signal.
    """
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def parent_death_preexec(signum: int, parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` arming ``signum`` as the child's parent-death signal; ``None`` where unsupported.

    ``prctl`` is looked up here, in the parent, so the forked child only makes the call. After arming, the child
    checks that its parent is still ``parent_pid``: a parent that died between ``fork`` and ``prctl`` would never
    send the signal, so the child exits at once with ``128+signum`` instead of running without an owner.
    """
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(signal_exit_code(signum))

    return preexec


def leave_now(code: int) -> NoReturn:
    """End this process with ``code`` at once: stdio and logging flushed, then ``os._exit`` (no finalization: its
    atexit hooks and finalizers do not run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging = sys.modules.get("logging")  # flushed where this process logs (not imported here: the exec shim's cost)
    if logging is not None:
        logging.shutdown()
    os._exit(code)


def leave_if_threads_left(code: int) -> int:
    """``code`` when the calling thread is the process's last, else :func:`leave_now` with it.

    A thread still alive when the entry point returns was given up on: finalization would race its C++ call's
    return (a store host that exits with this job closes the connection, and the blocked call returns then: within
    the ~0.1 s torch's finalization lasts, the process aborts). Leaving at once takes nothing the process still owes:
    its work is done and its threads are abandoned."""
    if any(t is not threading.current_thread() for t in threading.enumerate()):
        leave_now(code)
    return code
