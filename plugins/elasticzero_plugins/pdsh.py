"""pdsh over ssh: ``pdsh -R ssh -S -w h1,h2 '<remote command>'``, one agent per host.

Exit code: ``-S`` makes pdsh return the *largest* remote exit code (ssh's 255 for an unreachable host), i.e. the
largest of the agents' codes, not necessarily the code of the rank that failed first.

Environment values never travel in a command line (any user can read ``/proc/*/cmdline`` on both machines).
pdsh does not forward its stdin (verified with pdsh 2.34: the remote side reads nothing), so :meth:`PdshBackend.stage`
first runs one ``ssh HOST 'umask 077 && mkdir DIR && cat > DIR/env'`` per host, in parallel, with the
``export K='V'`` lines on ssh's *stdin*; ``DIR`` is ``${TMPDIR:-/tmp}/elasticzero-env-<job id>-<nonce>.<host>``
(a fresh 0700 directory: ``mkdir`` fails on anything already there, symlinks included). The pdsh remote command
then reads the file into the shell, deletes it and its directory, and only then applies it::

    ezd="${TMPDIR:-/tmp}"/elasticzero-env-JOB-NONCE.%h && eze=$(cat -- "$ezd/env") && rm -f -- "$ezd/env"
      && rmdir -- "$ezd" && eval "$eze" && cd DIR && exec PYTHON -u -m elasticzero.agent.cli … --node-host %h …

``export`` and ``eval`` are shell builtins, so the values only ever sit in shell memory and in the agent's own
environment (readable by the same user only), and they arrive byte-for-byte (``shlex.quote`` per value; newlines,
quotes, ``%`` and ``$(…)`` included). A run that does not succeed ends with :meth:`PdshBackend.unstage` removing
any file a host did not consume.

ssh runs one string through the remote login shell, so this is the one place elasticzero builds a shell string,
with every path and argv element passed through :func:`shlex.quote`. pdsh itself rewrites ``%h``/``%n``/``%u``/``%%``
anywhere in that string (ssh mode included), so every ``%`` of user data is doubled and the only live sequences are
the host's ``%h`` in the agent's ``--node-host %h`` and in the env directory's name.

With ``--max-node-restarts`` (launcher option ``max_node_restarts``) the launch is one ``pdsh -w HOST`` per node, each
restartable alone; :meth:`PdshBackend.restart_node` readies a host for its agent's new start (stop what is left of
that node, ``--kill-job JOB --node-host HOST``; remove a stale env file; stage it again).

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.backend import BackendOption, Command, LauncherBackend
from elasticzero_plugins._common import check_plan, job_env

if TYPE_CHECKING:
    from elasticzero.launch.plan import BoundPlan, LaunchPlan

SSH_CHECK_TIMEOUT = 20.0
STOP_TIMEOUT = 30.0
STAGE_TIMEOUT = 60.0
#: the variable carrying pdsh's extra ssh options
SSH_APPEND = "PDSH_SSH_ARGS_APPEND"
#: the per-host directory that carries the exported environment: ``<prefix><job id>-<nonce>.<host>``
ENV_DIR_PREFIX = "elasticzero-env-"


def env_dir(plan: LaunchPlan, host: str) -> str:
    """Shell text setting ``$ezd`` to this plan's env directory on ``host`` (expanded by the remote shell)."""
    return f'ezd="${{TMPDIR:-/tmp}}"/{shlex.quote(f"{ENV_DIR_PREFIX}{plan.job_id}-{plan.nonce}.{host}")}'


def env_payload(env: dict[str, str]) -> bytes:
    """The env file: one ``export K=<shlex-quoted value>`` line per variable (byte-exact, surrogates kept)."""
    text = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    return text.encode("utf-8", "surrogateescape")


def stage_script(plan: LaunchPlan, host: str) -> str:
    """Remote shell text writing ssh's stdin into a fresh private env directory (fails if anything is there)."""
    return f'umask 077 && {env_dir(plan, host)} && mkdir -- "$ezd" && cat > "$ezd/env"'


def unstage_script(plan: LaunchPlan, host: str) -> str:
    """Remote shell text removing the env file and directory if the agent did not (always exits 0)."""
    return f'{env_dir(plan, host)}; rm -f -- "$ezd/env"; rmdir -- "$ezd" 2>/dev/null; exit 0'


def remote_command(load_env: str, cwd: str, argv: list[str], *, host_placeholder: str | None = None) -> str:
    """The string the remote shell runs, escaped for pdsh's ``%`` substitution.

    ``load_env`` is shell text setting ``$ezd`` (:func:`env_dir`); the file there is read, deleted, then applied.
    ``host_placeholder``, if given, is replaced by pdsh's ``%h`` (the host's ``-w`` name) everywhere.
    """
    load = f'{load_env} && eze=$(cat -- "$ezd/env") && rm -f -- "$ezd/env" && rmdir -- "$ezd" && eval "$eze"'
    run = "exec " + " ".join(shlex.quote(a) for a in argv)
    text = f"{load} && cd {shlex.quote(cwd)} && {run}".replace("%", "%%")
    if host_placeholder is not None:
        if text.count(host_placeholder) != load_env.count(host_placeholder) + argv.count(host_placeholder):
            raise UsageError("internal error: host placeholder collided with user data; retry the launch")
        text = text.replace(host_placeholder, "%h")
    return text


def ssh_args_append(plan: LaunchPlan) -> str:
    """``PDSH_SSH_ARGS_APPEND`` for the launch: the user's value, then batch mode and the plan's port.

    It must split as a shell would (:func:`ssh_base` runs the same options for the preflight, the staging and the
    cleanup), so a value that does not is a :class:`UsageError` while the plan is bound, before anything starts.
    """
    append = ["-o BatchMode=yes"]
    if plan.options.get("ssh_port"):
        append.append(f"-p {int(plan.options['ssh_port'])}")
    prior = os.environ.get(SSH_APPEND, "").strip()
    text = " ".join([prior, *append]).strip()
    try:
        shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{SSH_APPEND}={prior!r} cannot be split: {exc}; balance its quotes") from None
    return text


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


def ssh_base(bound: BoundPlan) -> list[str]:
    """The ``ssh`` that the bound pdsh command runs, for the preflight, the staging and the cleanup.

    Same options as the launch: pdsh's ``-l USER`` from ``--launcher-args``, then the ``PDSH_SSH_ARGS_APPEND``
    the bound command carries (the user's value, ``-o BatchMode=yes``, ``-p PORT``), split as a shell would
    (pdsh's own splitting is on blanks; quotes are the user's to avoid there). ``ConnectTimeout`` comes last, so a
    value the user set wins (ssh keeps the first ``-o`` of each option).
    """
    append = shlex.split(bound.commands[0].env[SSH_APPEND])  # every pdsh command carries the same options
    return ["ssh", *_pdsh_login(bound.plan.launcher_args), *append, "-o", "ConnectTimeout=10"]


class PdshBackend(LauncherBackend):
    """One ``pdsh -R ssh`` fan-out starting ``elasticzero-run --node-host %h`` on every host."""

    name = "pdsh"
    required_programs = ("pdsh", "ssh")
    options = (
        BackendOption("ssh_port", int, None, "ssh port (launch, preflight and cleanup)", flag="--ssh-port"),
        BackendOption("ssh_check", bool, True, "check passwordless ssh to every host first", flag="--no-ssh-check"),
    )

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        placeholder = f"EZHOST{uuid.uuid4().hex}"
        argv = plan.agent_argv(["--node-host", placeholder])
        remote = remote_command(env_dir(plan, placeholder), plan.cwd, argv, host_placeholder=placeholder)
        env = {SSH_APPEND: ssh_args_append(plan)}
        if plan.options.get("max_node_restarts"):  # supervised: one command per node, each restartable alone
            return [Command(argv=self._pdsh(plan, [n.host], remote), env=env, host=n.host) for n in plan.nodes]
        return [Command(argv=self._pdsh(plan, [n.host for n in plan.nodes], remote), env=env)]

    @staticmethod
    def _pdsh(plan: LaunchPlan, hosts: list[str], remote: str) -> tuple[str, ...]:
        fanout = ["-f", str(max(32, len(hosts)))]
        return ("pdsh", "-R", "ssh", "-S", *fanout, "-w", ",".join(hosts), *plan.launcher_args, remote)

    def preflight(self, bound: BoundPlan) -> None:
        """Check passwordless ssh (``BatchMode=yes``) to every host, unless ``ssh_check`` is false."""
        if not bound.plan.options["ssh_check"]:
            return
        for host, err in on_hosts(bound, lambda _host: "true", SSH_CHECK_TIMEOUT).items():
            if err is not None:
                raise UsageError(
                    f"passwordless ssh to {host!r} failed ({err}); set up key-based login "
                    "or pass --no-ssh-check to skip this check"
                )

    def stage(self, bound: BoundPlan) -> None:
        """Write the exported environment into a private file on every host, over ssh's stdin (see module doc)."""
        plan = bound.plan
        payload = env_payload(job_env(plan))
        staged = on_hosts(bound, lambda h: stage_script(plan, h), STAGE_TIMEOUT, payload)
        failed = {h: e for h, e in staged.items() if e}
        if failed:
            host, err = next(iter(failed.items()))
            raise UsageError(
                f"cannot deliver the environment to {host!r} over ssh ({err}); nothing was started "
                f"({len(failed)} of {len(plan.nodes)} host(s) failed)"
            )

    def unstage(self, bound: BoundPlan) -> None:
        """Remove every host's env file the agent did not consume (a host that cannot be reached is named)."""
        for host, err in on_hosts(bound, lambda h: unstage_script(bound.plan, h), STOP_TIMEOUT).items():
            if err is not None:
                _report(f"could not remove the job's env file on {host}: {err} ({unstage_script(bound.plan, host)})")

    def restart_node(self, bound: BoundPlan, host: str) -> str | None:
        """Make ``host`` ready for its command to start again: stop what is left of this node there (the agent may
        still run when only the launcher's connection died), remove a stale env file, stage the environment again.
        Returns what failed (one line), or None."""
        plan = bound.plan
        kill = [plan.agent.python, "-m", "elasticzero.agent.cli", "--kill-job", plan.job_id, "--node-host", host]
        steps = [(lambda _h: shlex.join(kill), b""), (lambda h: unstage_script(plan, h), b"")]
        steps.append((lambda h: stage_script(plan, h), env_payload(job_env(plan))))
        for remote, stdin in steps:
            err = on_hosts(bound, remote, STOP_TIMEOUT, stdin, hosts=[host])[host]
            if err is not None:
                return f"{err} ({remote(host)[:200]})"
        return None

    def stop_job(self, bound: BoundPlan) -> None:
        """Kill this job's processes on every host: ``ssh HOST elasticzero-run --kill-job JOB`` in parallel.

        The kill is scoped by the ``ELASTICZERO_JOB_ID`` the job's processes carry. The ssh uses the launch's
        options (:func:`ssh_base`) and runs in its own session, so a second Ctrl-C at the terminal cannot kill it
        mid-cleanup. Each host where the kill failed (ssh error, non-zero exit, no answer within
        :data:`STOP_TIMEOUT`) is reported on stderr, one line per host; the other hosts are still cleaned.
        """
        plan = bound.plan
        remote = shlex.join([plan.agent.python, "-m", "elasticzero.agent.cli", "--kill-job", plan.job_id])
        for host, err in on_hosts(bound, lambda _host: remote, STOP_TIMEOUT).items():
            if err is not None:
                _report(f"could not stop job {plan.job_id} on {host}: {err} (run elasticzero-run --kill-job there)")


def on_hosts(
    bound: BoundPlan,
    remote: Callable[[str], str],
    timeout: float,
    stdin: bytes = b"",
    hosts: list[str] | None = None,
) -> dict[str, str | None]:
    """Run ``ssh HOST remote(HOST)`` on every host (or ``hosts``) in parallel (launch ssh options, own session):
    host → error.

    ``stdin`` is what each ssh reads (the remote command's stdin); the error is ``None`` on success, else ssh's
    last stderr line with the exit code, or the timeout.
    """
    base = ssh_base(bound)

    def run(host: str) -> str | None:
        try:
            p = subprocess.run(
                [*base, host, remote(host)],
                input=stdin,
                capture_output=True,
                timeout=timeout,
                start_new_session=True,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout:.0f} s"
        except OSError as exc:
            return f"cannot run ssh: {exc}"
        if p.returncode == 0:
            return None
        tail = (p.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
        return f"exit code {p.returncode}" + (f": {tail}" if tail else "")

    hosts = hosts if hosts is not None else [n.host for n in bound.plan.nodes]
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return dict(zip(hosts, pool.map(run, hosts), strict=True))


def _report(message: str) -> None:
    """One line on stderr; silent when stderr is gone (the terminal was closed)."""
    try:
        print(f"elasticzero-launch: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
