"""End to end through the real ``elasticzero-launch`` console script: hostfile → plan → backend → agents → workers."""

from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launchkit import (
    WORKER,
    hostile_args,
    hostile_dir,
    hostile_env,
    kill_job,
    leftovers,
    markers,
    wait_for,
    worker_env_clean,
)
from test_real_launch import bed, check_reports

from ez_testing import free_port

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]


def cli_run(
    tmp_path: Path, backend: str, hosts: list[str], extra: list[str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path, list[list[Any]]]:
    mark = tmp_path / "mark"
    mark.mkdir()
    token = f"EZPWN{secrets.token_hex(4)}"
    cwd = hostile_dir(tmp_path, token)
    out = tmp_path / "out"
    out.mkdir()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# reverse name order on purpose\n{hosts[1]} slots=2\n{hosts[0]} slots=2\n")
    env = {**hostile_env(mark), "EZ_TEST_OUT": str(out)}
    job = f"ezcli-{backend}-{secrets.token_hex(4)}"
    argv = [LAUNCH, "--hostfile", str(hostfile), "--launcher", backend, "--master-port", str(free_port())]
    argv += ["--rdzv-id", job, f"--save-pid={tmp_path / 'launcher.pid'}"]
    for name in env:
        argv += ["--export", name]
    argv += [*extra, WORKER, *hostile_args(mark)]
    try:
        p = subprocess.run(
            argv, cwd=cwd, env={**worker_env_clean(), **env, "OMP_NUM_THREADS": "1"},
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        kill_job(job)
        raise
    nodes = [[hosts[1], [0, 1]], [hosts[0], [0, 1]]]
    spec = {"env": {"EZ_TEST_OUT": str(out)}, "job_id": job}
    assert markers(mark, token, tmp_path, cwd) == []
    assert not (tmp_path / "launcher.pid").exists(), "--save-pid file must be removed at exit"
    if p.returncode == 0:
        check_reports(spec, nodes, hostile_args(mark), hostile_env(mark), cwd)
    return p, spec, cwd, nodes


# One backend is enough here: that the console script hands execute() exactly the commands its plan binds is proven
# for every backend by tests/unit/launch/test_launch_cli.py (test_dry_run_prints_the_very_commands_execute_runs), and
# that those commands run on the real hosts, hostile strings and all, by test_real_launch.py for every backend and
# mode; a real console-script launch per backend repeated that composition.
@pytest.mark.pdsh
@pytest.mark.sshd
def test_elasticzero_launch_end_to_end(tmp_path: Path) -> None:
    tb, hosts = bed("pdsh")
    p, spec, _, _ = cli_run(tmp_path, "pdsh", hosts, [])
    assert p.returncode == 0, p.stderr[-6000:]
    assert leftovers(spec["job_id"], tb) == {}


@pytest.mark.parametrize("host", ["node1;touch /tmp/ezpwn-host", "$(touch /tmp/ezpwn-host)", "-oProxyCommand=x"])
def test_hostile_host_in_hostfile_exits_2_and_starts_nothing(host: str, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"node1 slots=1\n{host} slots=1\n")
    p = subprocess.run(
        [LAUNCH, "--hostfile", str(hostfile), "--launcher", "pdsh", "--no-ssh-check", WORKER],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("elasticzero-launch: error:") and "host" in p.stderr
    assert not Path("/tmp/ezpwn-host").exists()


@pytest.mark.pdsh
@pytest.mark.sshd
def test_sigint_to_elasticzero_launch_cleans_every_host(tmp_path: Path) -> None:
    tb, hosts = bed("pdsh")
    out = tmp_path / "out"
    out.mkdir()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{hosts[0]} slots=2\n{hosts[1]} slots=2\n")
    job = f"ezcli-sig-{secrets.token_hex(4)}"
    env = {**worker_env_clean(), "EZ_TEST_OUT": str(out), "EZ_TEST_SLEEP": "600", "OMP_NUM_THREADS": "1"}
    pid_file = tmp_path / "launcher.pid"
    argv = [LAUNCH, "--hostfile", str(hostfile), "--master-port", str(free_port()), "--rdzv-id", job]
    argv += [f"--save-pid={pid_file}", "--export", "EZ_TEST_OUT", "--export", "EZ_TEST_SLEEP", WORKER]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(list(out.glob("pid-*"))) == 4 or proc.poll() is not None, 180, "4 sleeping workers")
        assert proc.poll() is None
        assert pid_file.read_text().strip() == str(proc.pid)
        assert sorted(p.read_text() for p in out.glob("pid-*")) == sorted([hosts[0]] * 2 + [hosts[1]] * 2)
        assert leftovers(job, tb), "the job's processes should be visible before the signal"
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            kill_job(job)
    wait_for(lambda: not leftovers(job, tb), 20, "no process of the job on any host")
    assert not pid_file.exists()
    assert glob.glob(f"/tmp/elasticzero-env-{job}-*") == [], "an env file was left on a host"
