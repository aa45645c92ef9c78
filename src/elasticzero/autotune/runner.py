"""Thin I/O: start one experiment through ``elasticzero-launch``, report its exit, kill it by job id.

Each experiment is one ``python -m elasticzero.launch.cli`` process (any backend: the user's launcher flags are
passed on) on its reservation — a hostfile naming exactly its hosts plus an ``-i`` filter naming exactly its slots —
with its own ``--master-port`` and ``--job-id``, in its own session (process group), with
``PR_SET_PDEATHSIG`` so it stops its job when the tuner dies. Its output goes to ``stdout.log``/``stderr.log`` in
the experiment's directory, per-rank logs to ``ranks/``; the trial's report to ``metrics.json`` (named by
``$ELASTICZERO_AUTOTUNE_METRICS``).

A waiter thread per experiment blocks in ``wait()`` and posts the exit to the tuner's event queue: nothing polls.
A timed-out experiment is killed on every host of its reservation by the job-id scoped kill
(``elasticzero-run --kill-job JOB``, locally or over ssh), then its launcher's process group gets SIGKILL.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from elasticzero.autotune.contract import METRICS_ENV
from elasticzero.autotune.resources import Reservation
from elasticzero.autotune.window import MEASURE_ENV, WARMUP_ENV
from elasticzero.launch.hostfile import is_loopback
from elasticzero.proc import JOB_ID_ENV, parent_death_preexec

__all__ = ["ENV_PREFIX", "Running", "TrialLauncher", "kill_job_everywhere"]

ENV_PREFIX = "ELASTICZERO_AUTOTUNE_"
KILL_GRACE = 5.0
KILL_TIMEOUT = 60.0


@dataclass
class Running:
    """A started experiment: its process, reservation, port, job id, directory and deadline."""

    key: str
    proc: subprocess.Popen[bytes]
    reservation: Reservation
    port: int
    job_id: str
    directory: Path
    started: float
    deadline: float
    timed_out: bool = False


def launch_argv(
    python: str, directory: Path, reservation: Reservation, port: int, job_id: str, launch_flags: Sequence[str]
) -> list[str]:
    """The ``elasticzero-launch`` argv for one experiment (its entry follows after ``--``)."""
    return [
        python,
        "-m",
        "elasticzero.launch.cli",
        "--hostfile",
        str(directory / "hostfile"),
        "--include",
        reservation.include(),
        "--master-port",
        str(port),
        "--job-id",
        job_id,
        "--export-prefix",
        ENV_PREFIX,
        "--log-dir",
        str(directory / "ranks"),
        *launch_flags,
    ]


class TrialLauncher:
    """Starts experiments and posts ``(key, exit code)`` to :attr:`events` when each launcher process exits."""

    def __init__(self, python: str, launch_flags: Sequence[str], cwd: str, env: Mapping[str, str], ssh: Sequence[str]):
        self.python = python
        self.launch_flags = list(launch_flags)
        self.cwd = cwd
        self.env = dict(env)
        self.ssh = list(ssh)
        self.events: queue.Queue[tuple[str, int]] = queue.Queue()

    def start(
        self,
        key: str,
        entry: Sequence[str],
        reservation: Reservation,
        port: int,
        job_id: str,
        directory: Path,
        warmup: int,
        steps: int,
        timeout: float,
    ) -> Running:
        (directory / "ranks").mkdir(parents=True, exist_ok=True)
        (directory / "hostfile").write_text(reservation.hostfile())
        (directory / "metrics.json").unlink(missing_ok=True)
        argv = [*launch_argv(self.python, directory, reservation, port, job_id, self.launch_flags), "--", *entry]
        (directory / "argv.json").write_text(json.dumps(argv, indent=1) + "\n")
        env = {**self.env, METRICS_ENV: str(directory / "metrics.json"), WARMUP_ENV: str(warmup)}
        env.update({MEASURE_ENV: str(steps), JOB_ID_ENV: job_id})
        with open(directory / "stdout.log", "wb") as out, open(directory / "stderr.log", "wb") as err:
            proc = subprocess.Popen(  # the child holds its own copies of the log descriptors
                argv,
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_die_with_tuner(),
            )
        now = time.monotonic()
        run = Running(key, proc, reservation, port, job_id, directory, now, now + timeout)
        threading.Thread(target=self._wait, args=(key, proc), daemon=True, name=f"autotune-wait-{key}").start()
        return run

    def _wait(self, key: str, proc: subprocess.Popen[bytes]) -> None:
        self.events.put((key, proc.wait()))

    def kill(self, run: Running) -> list[str]:
        """Kill the experiment's job on every host (job-id scoped), then its launcher's group; host errors."""
        errors = kill_job_everywhere(run.reservation.hosts, run.job_id, self.python, self.ssh)
        stop_group(run.proc)
        return errors


def _die_with_tuner() -> Callable[[], None] | None:
    """The launcher's ``PR_SET_PDEATHSIG=SIGTERM`` preexec: a launcher never outlives the tuner."""
    return parent_death_preexec(signal.SIGTERM, os.getpid())


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher's process group (its session) if anything of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_job_everywhere(hosts: Sequence[str], job_id: str, python: str, ssh: Sequence[str]) -> list[str]:
    """``elasticzero-run --kill-job JOB`` on every host (loopback: directly; others: over ssh); failures by host."""
    local = [python, "-m", "elasticzero.agent.cli", "--kill-job", job_id, "--grace", str(KILL_GRACE)]

    def kill(host: str) -> str | None:
        argv = local if is_loopback(host) else [*ssh, host, shlex.join(local)]
        try:
            p = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=KILL_TIMEOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                check=False,
            )
        except (subprocess.TimeoutExpired, OSError) as exc:
            return f"{host}: {exc}"
        if p.returncode != 0:
            return f"{host}: exit code {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
        return [e for e in pool.map(kill, hosts) if e]


def ssh_argv(port: int | None) -> list[str]:
    """The ssh used for remote kills: batch mode (never a prompt), the launch's ``--ssh-port``."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    return [*argv, "-p", str(port)] if port else argv
