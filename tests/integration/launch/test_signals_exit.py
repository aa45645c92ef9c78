"""Signals and exit codes on the real test bed.

SIGINT/SIGTERM to the launcher must stop the job on every host (checked per namespace host with
``ip netns pids`` + the job id in each process's environment) and exit with 128+signal; a failing rank's code
reaches the launcher; a rank killed by a signal is reported as 128+signal.
"""

from __future__ import annotations

import glob
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from launchkit import explain_for, kill_job, launch, leftovers, make_spec, reports, start, wait_for
from test_real_launch import MARKS, OPTIONS, bed

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]

# pdsh's SIGINT is test_cli_e2e.py::test_sigint_to_elasticzero_launch_cleans_every_host (the same job and checks,
# through the console script)
SIGNAL_CASES = [
    ("pdsh", signal.SIGTERM, False),
    ("openmpi", signal.SIGTERM, False),
    ("mpich", signal.SIGINT, False),
    ("slurm", signal.SIGTERM, False),
    ("mpich", signal.SIGTERM, True),
    ("slurm", signal.SIGINT, True),
]


def _case(backend: str, sig: signal.Signals, per_rank: bool) -> Any:
    mode = "-per-rank" if per_rank else ""
    return pytest.param(backend, sig, per_rank, marks=MARKS[backend], id=f"{backend}{mode}-{sig.name}")


@pytest.mark.parametrize(("backend", "sig", "per_rank"), [_case(*c) for c in SIGNAL_CASES])
def test_signal_stops_job_on_every_host(backend: str, sig: signal.Signals, per_rank: bool, tmp_path: Path) -> None:
    tb, hosts = bed(backend)
    nodes = [[hosts[0], [0, 1]], [hosts[1], [0, 1]]]
    options = {**OPTIONS.get(backend, {}), **({"per_rank": True} if per_rank else {})}  # pdsh has no per_rank
    spec = make_spec(tb, backend, tmp_path, nodes=nodes, env={"EZ_TEST_SLEEP": "600"}, options=options)
    out = Path(spec["env"]["EZ_TEST_OUT"])
    proc = start(spec, tmp_path)
    try:
        wait_for(
            lambda: len(list(out.glob("pid-*"))) == 4 or proc.poll() is not None,
            180,
            "4 sleeping workers",
            explain_for(backend),
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        on_hosts = sorted(p.read_text() for p in out.glob("pid-*"))
        assert on_hosts == sorted([hosts[0]] * 2 + [hosts[1]] * 2)
        assert leftovers(spec["job_id"], tb), "the job's processes should be visible before the signal"
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            kill_job(spec["job_id"])
    assert proc.returncode == 128 + sig, output[-3000:]
    wait_for(lambda: not leftovers(spec["job_id"], tb), 20, "no process of the job on any host")
    assert glob.glob(f"/tmp/elasticzero-env-{spec['job_id']}-*") == [], "an env file was left on a host"


@pytest.mark.parametrize(
    ("backend", "per_rank", "fail", "expect"),
    [
        # agent mode: every rank exits 7 (a lone failure leaves the other agents in torch's 300 s exit barrier)
        pytest.param("pdsh", False, "*:7", 7, marks=MARKS["pdsh"], id="pdsh-exit7"),
        pytest.param("slurm", False, "*:7", 7, marks=MARKS["slurm"], id="slurm-exit7"),
        # per-rank mode: rank 2 dies of SIGKILL; hydra alone would report a bare 9
        pytest.param("openmpi", True, "2:KILL", 128 + 9, marks=MARKS["openmpi"], id="openmpi-perrank-sigkill"),
        pytest.param("mpich", True, "2:KILL", 128 + 9, marks=MARKS["mpich"], id="mpich-perrank-sigkill"),
    ],
)
def test_failing_rank_exit_code(backend: str, per_rank: bool, fail: str, expect: int, tmp_path: Path) -> None:
    tb, hosts = bed(backend)
    nodes = [[hosts[0], [0, 1]], [hosts[1], [0, 1]]]
    spec = make_spec(
        tb,
        backend,
        tmp_path,
        nodes=nodes,
        env={"EZ_TEST_EXIT_RANK": fail},
        options={"per_rank": True} if per_rank else {},
    )
    p: subprocess.CompletedProcess[str] = launch(spec, tmp_path)
    assert p.returncode == expect, (p.stdout[-2000:], p.stderr[-2000:])
    assert len(reports(spec)) == 4  # every rank got through the all_reduce before failing
    wait_for(lambda: not leftovers(spec["job_id"], tb), 20, "no process of the job on any host")
