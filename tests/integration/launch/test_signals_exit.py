"""Signals and exit codes on the real test bed.

SIGINT/SIGTERM to the launcher must stop the job on every host (checked per namespace host with
``ip netns pids`` + the job id in each process's environment) and exit with 128+signal. A failing rank's code
reaching the launcher (and a rank killed by a signal reported as 128+signal) is asserted on test_real_launch.py's
launches, whose ranks fail once they have reported.
"""

from __future__ import annotations

import glob
import signal
from pathlib import Path
from typing import Any

import pytest
from launchkit import explain_for, kill_job, leftovers, make_spec, start, wait_for
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
