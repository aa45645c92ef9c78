"""Run a :class:`~elasticzero.launch.plan.BoundPlan`: start its commands, wait, stop them on a signal.

The commands are the bound plan's, exactly as ``--dry-run`` prints them: nothing is rebuilt here. Each
:class:`~elasticzero.launch.plan.Command` starts as a local process from its argv list (never a shell),
with ``os.environ`` plus ``command.env``, in the plan's ``cwd``, in its own session so a terminal's Ctrl-C reaches the
launcher only; its output goes straight to the launcher's stdout/stderr.

Exception: a backend whose one command needs no live launcher (``local``, ``no-ssh``:
:attr:`~elasticzero.launch.backend.LauncherBackend.replaces_launcher`) run by ``elasticzero-launch``
(``replace_process=True``) without ``--save-pid`` — the launcher ``exec``s that command (:func:`exec_in_place`):
the agent keeps the launcher's pid, so signals sent to the launcher reach it directly and it applies the same rules
(stop the workers, exit ``128+signal``; root-cause exit code), with no second interpreter waiting beside it.
With ``--save-pid`` the launcher stays, to remove the file at exit.

Exit code: 0 when every command succeeds; otherwise the code of the first command that failed, ``128+signal``
for a command killed by a signal. A transport command combines its processes' codes its own way (docs/launching.md,
"Signals and exit codes"): ``pdsh -S`` and ``srun`` report the largest, hydra the bitwise OR, OpenMPI's
``mpirun`` the first failure's; only with one failing node (or equal codes) is it the first failing rank's code.

On SIGINT, SIGTERM, SIGHUP (terminal closed) or SIGQUIT the launcher stops the job everywhere, waits for
its commands, and exits with ``128+signal``: first the backend's optional ``stop_job(bound)`` (for transports that
do not stop remote processes themselves, e.g. pdsh), then SIGTERM to each command's process group, SIGKILL after a
grace period.

A launcher that cannot run handlers (SIGKILL, a crash) still takes its local commands along: each is started with
``PR_SET_PDEATHSIG=SIGTERM`` (Linux), so the local agent, ``mpirun``, ``mpiexec`` or ``srun`` get SIGTERM and stop
their part of the job as they do on Ctrl-C. pdsh is the exception: terminating pdsh leaves the remote agents
running, and only :meth:`stop_job` (which needs a live launcher) removes them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from elasticzero.errors import UsageError
from elasticzero.launch.backend import RestartsNodes
from elasticzero.launch.supervise import JobView, Restart, backoff, is_node_loss, job_exit, on_exit
from elasticzero.proc import STOP_SIGNALS, exit_status, parent_death_preexec, signal_exit_code

if TYPE_CHECKING:
    import subprocess  # imported when commands start: a launcher that execs its one command never needs it

    from elasticzero.launch.backend import LauncherBackend
    from elasticzero.launch.plan import BoundPlan, Command

#: seconds a command gets between SIGTERM and SIGKILL
STOP_GRACE = 15.0
#: seconds other commands may keep running after one failed, before they are stopped
FAIL_GRACE = 30.0
#: seconds between looks at the commands (their exit is noticed POLL/2 late on average; 50 wake-ups/s cost nothing)
POLL = 0.02


@runtime_checkable
class StopsJob(Protocol):
    """A backend whose transport leaves remote processes running when terminated (pdsh)."""

    def stop_job(self, bound: BoundPlan) -> None: ...


def execute(bound: BoundPlan, backend: LauncherBackend, *, replace_process: bool = False) -> int:
    """Start ``bound.commands``, wait, and return the exit code.

    ``bound`` comes from ``backend.bind(plan)``; the caller runs ``backend.preflight(bound)`` first
    (``elasticzero-launch`` does). ``replace_process=True`` (the ``elasticzero-launch`` process, which has nothing
    left to do after the job) lets a backend that
    :attr:`~elasticzero.launch.backend.LauncherBackend.replaces_launcher` take this process over
    (:func:`exec_in_place`); a library caller keeps its process and gets a child.
    """
    plan, commands = bound.plan, bound.commands
    pid_file = plan.options.get("save_pid")
    if replace_process and backend.replaces_launcher and len(commands) == 1 and not pid_file:
        return exec_in_place(plan.cwd, commands[0])
    if pid_file:
        write_pid_file(str(pid_file))
    received: list[int] = []
    restore = _install_handlers(received.append)
    code = 1
    try:
        backend.stage(bound)  # what the commands need on the nodes (pdsh: the env file); nothing changed before
        code = _run(bound, backend, received)
        return code
    finally:
        if code != 0:
            backend.unstage(bound)  # remove what the job did not consume
        restore()
        if pid_file:
            Path(pid_file).unlink(missing_ok=True)


def write_pid_file(path: str) -> None:
    """Create ``path`` (mode 0600) holding this process's pid; never follow or reuse an existing file.

    ``O_EXCL|O_NOFOLLOW``: a file or symlink already at ``path`` (a stale pid file, or one planted to redirect
    the write) is a :class:`UsageError`, raised before anything starts.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UsageError(f"--save-pid: {path!r} already exists (a stale pid file or a symlink); remove it") from None
    except OSError as exc:
        raise UsageError(f"--save-pid: cannot create {path!r}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")


def _command_env(cmd: Command) -> dict[str, str]:
    """``os.environ`` plus the command's variables, last and in their order (see elasticzero_plugins.mpich)."""
    env = {k: v for k, v in os.environ.items() if k not in cmd.env}
    env.update(cmd.env)
    return env


def exec_in_place(cwd: str, cmd: Command) -> int:
    """Replace this process by ``cmd`` (``execvpe``: same pid, no launcher left to wait on it); 127 if it cannot.

    For a backend whose one local command needs no live launcher (:attr:`LauncherBackend.replaces_launcher`): the
    command then gets the signals sent to the launcher and its exit code is the launch's. As for a child, it runs
    in ``cwd`` with stdin from ``/dev/null`` and the signals Python ignores (SIGPIPE, SIGXFSZ) at default;
    it stays in the caller's session, so a terminal's Ctrl-C reaches it (torch's agent starts its workers in
    sessions of their own).
    """
    env = _command_env(cmd)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.chdir(cwd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for name in ("SIGPIPE", "SIGXFSZ"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        os.execvpe(cmd.argv[0], list(cmd.argv), env)
    except OSError as exc:
        print(f"elasticzero-launch: cannot start {cmd.argv[0]!r}: {exc}", file=sys.stderr)
    return 127


def _start(cwd: str, cmd: Command) -> subprocess.Popen[bytes]:
    import subprocess

    return subprocess.Popen(
        list(cmd.argv),
        env=_command_env(cmd),
        cwd=cwd,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=parent_death_preexec(signal.SIGTERM, os.getpid()),  # only prctl + getppid run in the child
    )


def _run(bound: BoundPlan, backend: LauncherBackend, received: list[int]) -> int:
    if bound.plan.options.get("max_node_restarts") and isinstance(backend, RestartsNodes):
        return _Supervisor(bound, backend, received).run()
    procs: list[subprocess.Popen[bytes]] = []
    commands = bound.commands
    try:
        for cmd in commands:
            if received:
                break
            procs.append(_start(bound.plan.cwd, cmd))
    except OSError as exc:
        _stop(bound, backend, procs)
        print(f"elasticzero-launch: cannot start {commands[len(procs)].argv[0]!r}: {exc}", file=sys.stderr)
        return 127
    first_failure: int | None = None
    failed_at = 0.0
    while True:
        if received:
            _stop(bound, backend, procs)
            return signal_exit_code(received[0])
        codes = [p.poll() for p in procs]
        for rc in codes:
            if rc not in (None, 0) and first_failure is None:
                first_failure, failed_at = exit_status(rc), time.monotonic()
        if all(rc is not None for rc in codes):
            return first_failure or 0
        if first_failure is not None and time.monotonic() - failed_at > FAIL_GRACE:
            _stop(bound, backend, procs)
            return first_failure
        time.sleep(POLL)


@dataclass
class _Node:
    """One node's command under supervision: its process, and a restart pending or being prepared."""

    cmd: Command
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0  # restarts decided for this node (its backoff)
    start_at: float | None = None  # a restart is due then
    preparing: Future[str | None] | None = None  # the backend is readying the host

    @property
    def active(self) -> bool:
        return self.proc is not None or self.start_at is not None


class _Supervisor:
    """``--max-node-restarts``: one command per node, a lost node's started again (decisions: ``launch.supervise``).

    The loop polls the commands; an ending goes to :func:`~elasticzero.launch.supervise.on_exit`; a restart, once
    due, is prepared by ``backend.restart_node`` on a thread (ssh round trips: the loop keeps watching the others
    and the signals), then the node's command starts again. A failed preparation (the host still unreachable) is
    tried again after the node's next backoff, without spending more of the budget.
    """

    def __init__(self, bound: BoundPlan, backend: LauncherBackend, received: list[int]) -> None:
        assert isinstance(backend, RestartsNodes)
        self.bound, self.backend, self.restarter, self.received = bound, backend, backend, received
        self.nodes = [_Node(cmd) for cmd in bound.commands]
        self.budget = int(bound.plan.options["max_node_restarts"])
        self.used = 0
        self.last: list[int] = []  # the endings not restarted, in the order they ended
        self.result_seen = False
        self.first_failure: tuple[int, float] | None = None
        self.staged_unused = False
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="node-restart")

    def run(self) -> int:
        try:
            for node in self.nodes:
                if self.received:
                    break
                node.proc = _start(self.bound.plan.cwd, node.cmd)
        except OSError as exc:
            self._stop()
            print(f"elasticzero-launch: cannot start {self.nodes[0].cmd.argv[0]!r}: {exc}", file=sys.stderr)
            return 127
        try:
            return self._loop()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            if self.staged_unused:
                self.backend.unstage(self.bound)

    def _loop(self) -> int:
        while True:
            if self.received:
                self._stop()
                return signal_exit_code(self.received[0])
            now = time.monotonic()
            for node in self.nodes:
                self._watch(node, now)
            if not any(n.active for n in self.nodes):
                return job_exit(self.last)
            if self.first_failure is not None and now - self.first_failure[1] > FAIL_GRACE:
                self._stop()
                return self.first_failure[0]
            time.sleep(POLL)

    def _watch(self, node: _Node, now: float) -> None:
        if node.proc is not None and (rc := node.proc.poll()) is not None:
            node.proc = None
            self._ended(node, exit_status(rc), now)
        if node.start_at is not None and now >= node.start_at and node.preparing is None:
            node.preparing = self.pool.submit(self.restarter.restart_node, self.bound, str(node.cmd.host))
        if node.preparing is not None and node.preparing.done():
            self._prepared(node, node.preparing.result(), now)

    def _ended(self, node: _Node, code: int, now: float) -> None:
        others = sum(1 for n in self.nodes if n is not node and n.active)
        view = JobView(others, self.result_seen, self.used, self.budget, node.restarts)
        decision = on_exit(str(node.cmd.host), code, view)
        if decision.line:
            print(f"elasticzero-launch: {decision.line}", file=sys.stderr, flush=True)
        if isinstance(decision, Restart):
            self.used, node.restarts, node.start_at = self.used + 1, node.restarts + 1, now + decision.delay_s
            return
        self.last.append(code)
        if not is_node_loss(code):
            self.result_seen = True
            if code != 0 and self.first_failure is None:
                self.first_failure = (code, now)

    def _prepared(self, node: _Node, error: str | None, now: float) -> None:
        node.preparing = None
        if error is not None:
            delay = backoff(node.restarts)
            node.restarts, node.start_at = node.restarts + 1, now + delay
            print(f"elasticzero-launch: cannot start {node.cmd.host}'s agent again yet: {error}; next try in "
                  f"{delay:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            return
        node.start_at = None
        if self.result_seen:
            self.staged_unused = True  # the job ended meanwhile: not started; its env file is removed at the end
            return
        try:
            node.proc = _start(self.bound.plan.cwd, node.cmd)
        except OSError as exc:
            print(f"elasticzero-launch: cannot start {node.cmd.argv[0]!r} again: {exc}", file=sys.stderr)

    def _stop(self) -> None:
        for node in self.nodes:
            node.start_at = None
        _stop(self.bound, self.backend, [n.proc for n in self.nodes if n.proc is not None])


def _stop(bound: BoundPlan, backend: LauncherBackend, procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the job: backend cleanup on every node, then the local commands (TERM, then KILL)."""
    import subprocess

    if isinstance(backend, StopsJob):
        backend.stop_job(bound)
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _install_handlers(on_signal: Callable[[int], None]) -> Callable[[], None]:
    """Record :data:`~elasticzero.proc.STOP_SIGNALS` instead of dying; returns a function restoring the previous
    handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    sigs = STOP_SIGNALS
    previous = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, lambda signum, _frame: on_signal(signum))

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    return restore
