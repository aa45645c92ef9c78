"""Helpers for the real-launch tests: plan specs, hostile strings, worker reports, per-host process checks."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ez_testing import REPO, Testbed, free_port

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "worker.py")
RUN_PLAN = str(HERE / "run_plan.py")
PYTHON = sys.executable
LAUNCH_TIMEOUT = 240.0
JOB_VAR = "ELASTICZERO_JOB_ID"


def hostile_args(mark: Path) -> list[str]:
    """User args that break anything that parses them as shell or as pdsh/launcher syntax."""
    return [
        "a;echo PWNED",
        f"$(touch {mark}/m-dollar)",
        f"`touch {mark}/m-backtick`",
        f"x; touch {mark}/m-semicolon",
        "it's",
        'say "hi"',
        "two words",
        "#not a comment",
        "*",
        "[ab]?",
        "new\nline",
        "%h %n %u %% 100%",
        "back\\slash",
        "",
        "--not-an-option",
        "${HOME}",
        "~",
        "tab\there",
    ]


def hostile_env(mark: Path) -> dict[str, str]:
    """Exported variables with values that must arrive byte-for-byte."""
    return {
        "EZT_COMMA": "a,b,c=d",
        "EZT_QUOTES": 'it\'s "quoted"',
        "EZT_SUBST": f"$(touch {mark}/m-env) `touch {mark}/m-env2`; echo PWNED",
        "EZT_NEWLINE": "line1\nline2",
        "EZT_GLOB": "* ? [x] # %h %%",
        "EZT_EMPTY": "",
    }


def hostile_dir(base: Path, token: str) -> Path:
    """A working directory whose name is hostile (created); an injected command would create file ``token``."""
    d = base / f"wd $(touch {token}) `touch {token}` ;touch {token} 'q' \"dq\" #y * %h\nline2"
    d.mkdir(parents=True)
    return d


def markers(mark: Path, token: str | None = None, *dirs: Path) -> list[str]:
    """Files created by injected commands (must be none): ``mark``'s content, ``token`` in likely cwds."""
    found = sorted(str(p) for p in mark.iterdir()) if mark.exists() else []
    if token:
        for d in {Path.home(), REPO, Path("/"), Path("/tmp"), *dirs}:
            if (d / token).exists():
                found.append(str(d / token))
    return found


def make_spec(
    tb: Testbed | None,
    backend: str,
    tmp: Path,
    *,
    nodes: list[list[Any]] | None = None,
    entry: list[str] | None = None,
    env: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    launcher_args: list[str] | None = None,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """A plan spec for run_plan.py: 2 hosts x 2 slots by default, worker output in ``tmp/out``."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    if nodes is None:
        assert tb is not None
        nodes = [[tb.hosts[0], [0, 1]], [tb.hosts[1], [2, 3]]]
    la = list(launcher_args or [])
    if backend in ("mpich", "mvapich") and tb is not None and not la:
        la = ["-localhost", tb.head_addr]  # hydra proxies call back to the root namespace by address
    return {
        "job_id": f"ezt-{backend}-{secrets.token_hex(4)}",
        "backend": backend,
        "nodes": nodes,
        "master_port": free_port(),
        "entry": entry or [WORKER],
        "cwd": str(cwd or tmp),
        "env": {"EZ_TEST_OUT": str(out), "OMP_NUM_THREADS": "1", **(env or {})},
        "options": options or {},
        "launcher_args": la,
        "python": PYTHON,
    }


def write_spec(spec: dict[str, Any], tmp: Path) -> Path:
    path = tmp / f"{spec['job_id']}.json"
    path.write_text(json.dumps(spec))
    return path


def launch(spec: dict[str, Any], tmp: Path, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run the plan to completion in a launcher process (hard timeout; the job is killed if it expires)."""
    try:
        return subprocess.run(
            [PYTHON, RUN_PLAN, str(write_spec(spec, tmp))],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=str(REPO),
        )
    except subprocess.TimeoutExpired:
        kill_job(spec["job_id"])
        raise


def kill_job(job_id: str) -> None:
    """Clean up after a failed test: ``elasticzero-run --kill-job`` (the namespace hosts share one PID space)."""
    subprocess.run(
        [PYTHON, "-m", "elasticzero.agent.cli", "--kill-job", job_id, "--grace", "2"],
        capture_output=True,
        timeout=60,
        check=False,
    )


def start(spec: dict[str, Any], tmp: Path) -> subprocess.Popen[str]:
    """Start the launcher process without waiting (for signal tests)."""
    return subprocess.Popen(
        [PYTHON, RUN_PLAN, str(write_spec(spec, tmp))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(REPO),
    )


def reports(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers' JSON reports, by rank."""
    out = Path(spec["env"]["EZ_TEST_OUT"])
    found = [json.loads(p.read_text()) for p in out.glob("rank-*.json")]
    return sorted(found, key=lambda r: r["dist_rank"])


def wait_for(pred: Any, timeout: float, what: str, explain: Callable[[], str] | None = None) -> None:
    """Poll ``pred`` until it holds; on time-out, fail with ``what`` and what ``explain()`` says of the state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{explain()}" if explain else ""))


SLURMCTLD_LOG = Path("/var/log/elasticzero-slurm/slurmctld.log")  # tests/cluster/slurm_up.sh


def _out(argv: list[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"
    return (p.stdout + p.stderr).strip()


def slurm_state() -> str:
    """The controller's view for a failure message: the queue with reasons, the nodes, each job's record and log."""
    queue = _out(["squeue", "-h", "-o", "%i %T %r cpus=%C nodes=%D %N"])
    parts = [f"squeue:\n{queue}", f"sinfo:\n{_out(['sinfo', '-h', '-N', '-o', '%N %T %C %E'])}"]
    for job in [line.split()[0] for line in queue.splitlines() if line.split() and line.split()[0].isdigit()]:
        parts.append(_out(["scontrol", "show", "job", "-d", job]))
        log = SLURMCTLD_LOG.read_text(errors="replace").splitlines() if SLURMCTLD_LOG.exists() else []
        parts.append("\n".join([x for x in log if f"JobId={job} " in x or f"JobId={job}\n" in x][-40:]))
    return "\n".join(parts)


def explain_for(backend: str) -> Callable[[], str] | None:
    """What a failed wait should add for ``backend`` (Slurm: the controller's view of the queue and nodes)."""
    return slurm_state if backend == "slurm" else None


def netns_pids(netns: str) -> list[int]:
    """PIDs of the processes in a namespace host (``ip netns pids``)."""
    p = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10, check=False)
    return [int(x) for x in p.stdout.split()]


def job_pids(job_id: str, pids: list[int] | None = None) -> list[int]:
    """Live processes (of ``pids``, or all) whose environment carries this job's id."""
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)] if pids is not None else psutil.process_iter()
    found = []
    for proc in procs:
        try:
            if proc.environ().get(JOB_VAR) == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def leftovers(job_id: str, tb: Testbed) -> dict[str, list[int]]:
    """This job's processes per namespace host and in the root namespace (empty lists = clean)."""
    left = {host: job_pids(job_id, netns_pids(ns)) for host, ns in zip(tb.hosts, tb.netns, strict=True)}
    left["<any>"] = job_pids(job_id)
    return {k: v for k, v in left.items() if v}


def worker_env_clean() -> dict[str, str]:
    """The test process environment without variables a transport would mistake for its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MV2_"))}


def all_pids() -> set[int]:
    """Every process on the machine, the namespace hosts' included.

    ``/proc`` of the test's PID namespace lists them all: a namespace host has a network and a UTS namespace of its own,
    not a PID namespace, and a PID namespace created below this one would still list its processes here.
    ``ip netns pids`` per host added nothing but three ``ip`` processes a scan (the watch's loop spent a core on them).
    """
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def argv_hits(needles: list[bytes], pids: set[int]) -> list[tuple[int, bytes]]:
    """Processes of ``pids`` whose argv (``/proc/PID/cmdline``) contains one of ``needles``."""
    hits = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            hits.append((pid, cmdline))
    return hits


class ArgvWatch:
    """Scan every process's argv, on every host, over and over while a job runs: ``hits`` must stay empty.

    The loop catches short-lived processes (ssh, the remote shell) as well as the long-lived ones; the test also
    calls :meth:`scan` at a point where every rank is known to be running.
    """

    def __init__(self, needles: list[bytes]) -> None:
        self.needles = needles
        self.hits: list[tuple[int, bytes]] = []
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def scan(self) -> None:
        self.hits += argv_hits(self.needles, all_pids())
        self.scans += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(0.01)  # pacing only: the job is synchronised on files, not on this

    def __enter__(self) -> ArgvWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
