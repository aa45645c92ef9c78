"""pdsh over ssh: ``pdsh -R ssh -S -w h1,h2 '<remote command>'``, one agent per host.

Exit code: ``-S`` makes pdsh return the *largest* remote exit code (ssh's 255 for an unreachable host), i.e. the
largest of the agents' codes, not necessarily the code of the rank that failed first.

ssh runs one string through the remote login shell, so this is the one place elasticzero builds a shell string:
``export K=V; …; cd DIR && exec ARGV`` with every value and argv element passed through :func:`shlex.quote`.
pdsh itself rewrites ``%h``/``%n``/``%u``/``%%`` anywhere in that string (ssh mode included), so every ``%`` of
user data is doubled and the only live sequence is the agent's ``--node-host %h``.

pdsh does not stop remote processes when it is terminated; :meth:`PdshBackend.stop_job` kills this job's
processes on every host over ssh (same ssh options as the launch), scoped by the job id the processes carry in
``ELASTICZERO_JOB_ID``, and names each host where that failed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero_plugins._common import check_plan, job_env, no_per_rank

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan

SSH_CHECK_TIMEOUT = 20.0
STOP_TIMEOUT = 30.0


def remote_command(env: dict[str, str], cwd: str, argv: list[str], *, host_placeholder: str | None = None) -> str:
    """The string the remote shell runs, escaped for pdsh's ``%`` substitution.

    ``host_placeholder``, if given, is an argv element replaced by pdsh's ``%h`` (the host's ``-w`` name).
    """
    parts = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    run = "exec " + " ".join(shlex.quote(a) for a in argv)
    text = "; ".join([*parts, f"cd {shlex.quote(cwd)} && {run}"]).replace("%", "%%")
    if host_placeholder is not None:
        if text.count(host_placeholder) != 1:
            raise UsageError("internal error: host placeholder collided with user data; retry the launch")
        text = text.replace(host_placeholder, "%h")
    return text


def ssh_args_append(plan: LaunchPlan) -> str:
    """``PDSH_SSH_ARGS_APPEND`` for the launch: the user's value, then batch mode and the plan's port."""
    append = ["-o BatchMode=yes"]
    if plan.options.get("ssh_port"):
        append.append(f"-p {int(plan.options['ssh_port'])}")
    prior = os.environ.get("PDSH_SSH_ARGS_APPEND", "").strip()
    return " ".join([prior, *append]).strip()


def _pdsh_login(launcher_args: tuple[str, ...]) -> list[str]:
    """pdsh's ``-l USER`` from ``--launcher-args`` as ssh options (pdsh hands it to ssh as ``-l USER``)."""
    found: list[str] = []
    args = list(launcher_args)
    for i, a in enumerate(args):
        if a == "-l" and i + 1 < len(args):
            found = ["-l", args[i + 1]]
        elif a.startswith("-l") and len(a) > 2:
            found = ["-l", a[2:]]
    return found


def ssh_base(plan: LaunchPlan) -> list[str]:
    """The ``ssh`` that pdsh runs for this plan, for the preflight and the cleanup.

    Same options as the launch: pdsh's ``-l USER`` from ``--launcher-args``, then ``PDSH_SSH_ARGS_APPEND`` as
    :meth:`PdshBackend.commands` sets it (the user's value, ``-o BatchMode=yes``, ``-p PORT``), split as a shell
    would (pdsh's own splitting is on blanks; quotes are the user's to avoid there). ``ConnectTimeout`` comes
    last, so a value the user set wins (ssh keeps the first ``-o`` of each option).
    """
    try:
        append = shlex.split(ssh_args_append(plan))
    except ValueError as exc:
        raise UsageError(f"PDSH_SSH_ARGS_APPEND cannot be split: {exc}") from None
    return ["ssh", *_pdsh_login(plan.launcher_args), *append, "-o", "ConnectTimeout=10"]


class PdshBackend(LauncherBackend):
    """One ``pdsh -R ssh`` fan-out starting ``elasticzero-run --node-host %h`` on every host."""

    name = "pdsh"
    required_programs = ("pdsh", "ssh")

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        no_per_rank(plan, self.name)
        placeholder = f"EZHOST{uuid.uuid4().hex}"
        remote = remote_command(
            job_env(plan), plan.cwd, plan.agent_argv(["--node-host", placeholder]), host_placeholder=placeholder
        )
        hosts = ",".join(n.host for n in plan.nodes)
        argv = ["pdsh", "-R", "ssh", "-S", "-f", str(max(32, len(plan.nodes))), "-w", hosts]
        argv += [*plan.launcher_args, remote]
        return [Command(argv=tuple(argv), env={"PDSH_SSH_ARGS_APPEND": ssh_args_append(plan)})]

    def preflight(self, plan: LaunchPlan) -> None:
        """Check passwordless ssh (``BatchMode=yes``) to every host, unless ``ssh_check`` is false."""
        if not plan.options.get("ssh_check", True):
            return
        check_plan(plan, self.name)

        def probe(host: str) -> str | None:
            try:
                p = subprocess.run(
                    [*ssh_base(plan), host, "true"],
                    capture_output=True,
                    text=True,
                    timeout=SSH_CHECK_TIMEOUT,
                    stdin=subprocess.DEVNULL,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return f"no answer within {SSH_CHECK_TIMEOUT:.0f} s"
            if p.returncode == 0:
                return None
            tail = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
            return tail

        hosts = [n.host for n in plan.nodes]
        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            results = list(pool.map(probe, hosts))
        for host, err in zip(hosts, results, strict=True):
            if err is not None:
                raise UsageError(
                    f"passwordless ssh to {host!r} failed ({err}); set up key-based login "
                    "or pass --no-ssh-check to skip this check"
                )

    def stop_job(self, plan: LaunchPlan) -> None:
        """Kill this job's processes on every host: ``ssh HOST elasticzero-run --kill-job JOB`` in parallel.

        The kill is scoped by the ``ELASTICZERO_JOB_ID`` the job's processes carry. The ssh uses the launch's
        options (:func:`ssh_base`) and runs in its own session, so a second Ctrl-C at the terminal cannot kill it
        mid-cleanup. Each host where the kill failed (ssh error, non-zero exit, no answer within
        :data:`STOP_TIMEOUT`) is reported on stderr, one line per host; the other hosts are still cleaned.
        """
        remote = " ".join(
            shlex.quote(a) for a in [plan.agent.python, "-m", "elasticzero.agent.cli", "--kill-job", plan.job_id]
        )
        try:
            base = ssh_base(plan)
        except UsageError as exc:
            _report(f"cannot stop job {plan.job_id} on any host: {exc}")
            return

        def kill(host: str) -> str | None:
            try:
                p = subprocess.run(
                    [*base, host, remote],
                    capture_output=True,
                    text=True,
                    errors="replace",
                    timeout=STOP_TIMEOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return f"no answer within {STOP_TIMEOUT:.0f} s"
            except OSError as exc:
                return f"cannot run ssh: {exc}"
            if p.returncode == 0:
                return None
            tail = (p.stderr.strip().splitlines() or [""])[-1]
            return f"exit code {p.returncode}" + (f": {tail}" if tail else "")

        hosts = [n.host for n in plan.nodes]
        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            results = list(pool.map(kill, hosts))
        for host, err in zip(hosts, results, strict=True):
            if err is not None:
                _report(f"could not stop job {plan.job_id} on {host}: {err} (run elasticzero-run --kill-job there)")


def _report(message: str) -> None:
    """One line on stderr; silent when stderr is gone (the terminal was closed)."""
    try:
        print(f"elasticzero-launch: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
