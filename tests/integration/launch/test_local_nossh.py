"""The single-node ``local`` backend and the per-node ``--no-ssh`` mode, through the real ``elasticzero-launch``."""

from __future__ import annotations

import secrets
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launchkit import (
    WORKER,
    hostile_args,
    job_pids,
    kill_job,
    leftovers,
    markers,
    reports,
    wait_for,
    worker_env_clean,
)
from test_real_launch import bed, check_reports

from ez_testing import AS_FROM_A_TERMINAL, free_port

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def _reports(out: Path) -> dict[str, object]:
    return {"env": {"EZ_TEST_OUT": str(out)}}


def test_local_backend_two_workers(tmp_path: Path) -> None:
    out, mark = tmp_path / "out", tmp_path / "mark"
    out.mkdir()
    mark.mkdir()
    job = f"ezt-local-{secrets.token_hex(4)}"
    args = hostile_args(mark)
    env = {**worker_env_clean(), "EZ_TEST_OUT": str(out), "EZT_V": "a,b 'c' $(x)", "OMP_NUM_THREADS": "1"}
    argv = [LAUNCH, "--launcher", "local", "--nproc-per-node", "2", "--rdzv-id", job, "--master-port", str(free_port())]
    argv += ["--export", "EZ_TEST_OUT", "--export", "EZT_V", WORKER, *args]
    try:
        p = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    except subprocess.TimeoutExpired:
        kill_job(job)
        raise
    assert p.returncode == 0, p.stderr[-4000:]
    spec = {**_reports(out), "job_id": job}
    reps = reports(spec)
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"], r["env"]["WORLD_SIZE"]) for r in reps] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert all(r["argv"] == args and r["exported"] == {"EZT_V": "a,b 'c' $(x)"} and r["job"] == job for r in reps)
    assert markers(mark) == []


@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL"])
def test_closed_terminal_or_killed_launcher_leaves_nothing(how: str, tmp_path: Path) -> None:
    """SIGHUP (terminal closed) stops the job and exits 129; a SIGKILLed launcher takes the agent along
    (parent-death signal), and the agent its workers."""
    out = tmp_path / "out"
    out.mkdir()
    job = f"ezt-local-{how.lower()}-{secrets.token_hex(4)}"
    env = {**worker_env_clean(), "EZ_TEST_OUT": str(out), "EZ_TEST_SLEEP": "600", "OMP_NUM_THREADS": "1"}
    argv = [LAUNCH, "--launcher", "local", "--nproc-per-node", "2", "--rdzv-id", job, "--master-port", str(free_port())]
    argv += ["--export", "EZ_TEST_OUT", "--export", "EZ_TEST_SLEEP", WORKER]
    # as from a terminal: a test run under nohup (or in a shell's background) would have the agent keep SIGHUP ignored
    proc = subprocess.Popen([*AS_FROM_A_TERMINAL, *argv], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: len(list(out.glob("pid-*"))) == 2 or proc.poll() is not None, 180, "2 sleeping workers")
        assert proc.poll() is None
        assert len(job_pids(job)) >= 3  # the agent and its two workers
        proc.send_signal(getattr(signal, how))
        rc = proc.wait(timeout=120)
        wait_for(lambda: not job_pids(job), 30, "no process of the job left")
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_job(job)
    assert rc == (128 + signal.SIGHUP if how == "SIGHUP" else -signal.SIGKILL)


@pytest.mark.sshd
def test_no_ssh_per_node_mode_on_two_hosts(tmp_path: Path) -> None:
    tb, hosts = bed("pdsh")
    out, mark = tmp_path / "out", tmp_path / "mark"
    out.mkdir()
    mark.mkdir()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{hosts[1]} slots=2\n{hosts[0]} slots=2\n")  # hostfile order, not name order
    job = f"ezt-nossh-{secrets.token_hex(4)}"
    args = hostile_args(mark)
    port = str(free_port())
    procs = []
    for rank, host in enumerate([hosts[1], hosts[0]]):
        inner = ["env", f"EZ_TEST_OUT={out}", "OMP_NUM_THREADS=1", LAUNCH, "--hostfile", str(hostfile)]
        inner += ["--no-ssh", "--node-rank", str(rank), "--rdzv-id", job, "--master-port", port]
        inner += ["--export", "EZ_TEST_OUT", WORKER, *args]
        remote = f"cd {shlex.quote(str(tmp_path))} && " + shlex.join(inner)
        procs.append(subprocess.Popen(["ssh", "-o", "BatchMode=yes", host, remote], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if any(p.returncode != 0 for p in procs):
            kill_job(job)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outputs]
    nodes = [[hosts[1], [0, 1]], [hosts[0], [0, 1]]]
    check_reports({**_reports(out), "job_id": job}, nodes, args, {}, tmp_path)
    assert markers(mark) == []
    assert leftovers(job, tb) == {}
