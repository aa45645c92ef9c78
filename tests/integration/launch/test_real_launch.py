"""Real launches on the namespace test bed: 2 hosts x 2 ranks, gloo all_reduce, hostile strings end to end, and
no exported value in any process's argv on any host (``/proc/*/cmdline`` of the root and every namespace host).

Each backend starts one ``elasticzero-run`` agent per host (or, per-rank mode, every rank through
``elasticzero.launch.rankenv``). Hosts are given in reverse name order, so node ranks must follow the plan
(hostfile) order, not the transport's. Workers report what they saw to files; the test compares byte-for-byte. On
four of the launches the ranks then fail (exit 7, or rank 2 SIGKILLed): the launcher must exit with that code.
"""

from __future__ import annotations

import glob
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
from launchkit import (
    LAUNCH_TIMEOUT,
    WORKER,
    ArgvWatch,
    explain_for,
    hostile_args,
    hostile_dir,
    hostile_env,
    kill_job,
    launch,
    leftovers,
    make_spec,
    markers,
    reports,
    start,
    wait_for,
)

import ez_testing
from ez_testing import require, require_program

PROGRAMS = {
    "pdsh": ("pdsh", "ssh"),
    "openmpi": ("mpirun.openmpi",),
    "mpich": ("mpiexec.hydra",),
    "mvapich": ("mpiexec.hydra",),
    "slurm": ("srun", "sinfo"),
}
MARKS = {
    "pdsh": [pytest.mark.pdsh, pytest.mark.sshd],
    "openmpi": [pytest.mark.openmpi, pytest.mark.sshd],
    "mpich": [pytest.mark.mpich, pytest.mark.sshd],
    "mvapich": [pytest.mark.mpich, pytest.mark.sshd],
    "slurm": [pytest.mark.slurm],
}
# MVAPICH2's mpiexec is hydra: run that flavour for real through MPICH's hydra binary
OPTIONS = {"mvapich": {"mvapich_launcher": "hydra", "mpiexec": "mpiexec.hydra"}}

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]


def bed(backend: str) -> tuple[ez_testing.Testbed, list[str]]:
    """The test bed and two hosts that ``backend`` can reach."""
    tb = ez_testing.testbed()
    require_program(*PROGRAMS[backend])
    hosts = list(tb.slurm_nodes if backend == "slurm" else tb.hosts)
    require(len(hosts) >= 2, f"{backend}: the test bed has fewer than 2 hosts for this backend")
    return tb, hosts[:2]


def params(*names: str) -> list[Any]:
    return [pytest.param(n, marks=MARKS[n], id=n) for n in names]


def check_reports(
    spec: dict[str, Any], nodes: list[list[Any]], args: list[str], env: dict[str, str], cwd: Path
) -> None:
    reps = reports(spec)
    assert [r["dist_rank"] for r in reps] == [0, 1, 2, 3], reps
    for r in reps:
        rank = r["dist_rank"]
        node = rank // 2
        assert r["dist_world"] == 4 and r["sum"] == 6.0
        assert r["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % 2),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node),
        }
        assert r["host"] == nodes[node][0], "node ranks must follow the plan's host order"
        assert r["cvd"] == ",".join(str(s) for s in nodes[node][1]), "the node's slots must be bound"
        assert r["job"] == spec["job_id"]
        assert r["argv"] == args
        assert r["exported"] == env
        assert r["cwd"] == str(cwd)


def hostile_launch(backend: str, tmp_path: Path, options: dict[str, Any], fail: str = "", expect: int = 0) -> None:
    """Hostile args/env/cwd arrive byte-for-byte, nothing is injected, and no secret value is ever in an argv.

    Every rank holds (``EZ_TEST_HOLD``) until the test has scanned every process's argv on every host with all
    ranks running; a background scan covers the whole launch (ssh, remote shells, transports, agents, ranks).
    ``fail`` (the worker's ``EZ_TEST_EXIT_RANK``): ranks that exit that way once they have reported; the launch must
    then exit ``expect`` and still leave nothing behind on any host.
    """
    tb, hosts = bed(backend)
    nodes = [[hosts[1], [0, 1]], [hosts[0], [2, 3]]]  # reverse name order on purpose
    mark = tmp_path / "mark"
    mark.mkdir()
    token = f"EZPWN{secrets.token_hex(4)}"
    cwd = hostile_dir(tmp_path, token)
    secret = f"s3cr3t{secrets.token_hex(8)}"
    args = hostile_args(mark)
    env = {**hostile_env(mark), "EZT_API_KEY": f"{secret} 'q' \"d\" $(touch {mark}/m-key) %h %%\nline2\n"}
    hold = tmp_path / "release"
    control = {"EZ_TEST_HOLD": str(hold), **({"EZ_TEST_EXIT_RANK": fail} if fail else {})}
    spec = make_spec(
        tb, backend, tmp_path, nodes=nodes, entry=[WORKER, *args], env={**env, **control}, options=options, cwd=cwd
    )
    out = Path(spec["env"]["EZ_TEST_OUT"])
    with ArgvWatch([secret.encode()]) as watch:
        proc = start(spec, tmp_path)
        try:
            wait_for(
                lambda: len(list(out.glob("held-*"))) == 4 or proc.poll() is not None,
                180,
                "4 ranks to hold",
                explain_for(backend),
            )
            watch.scan()  # every rank is running now
            hold.touch()
            log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                kill_job(spec["job_id"])
    assert proc.returncode == expect, log[-3000:]
    assert watch.hits == [], f"a secret value was in the argv of {watch.hits}"
    assert watch.scans > 10
    check_reports(spec, nodes, args, env, cwd)  # every rank reported: a failing one only after its all_reduce
    assert markers(mark, token, tmp_path, cwd) == [], "an injected command ran"
    wait_for(lambda: not leftovers(spec["job_id"], tb), 20, "no process of the job on any host")
    assert glob.glob(f"/tmp/elasticzero-env-{spec['job_id']}-*") == [], "an env file was left on a host"


# A failing rank's exit code reaches the launcher, on the same launches: (backend, EZ_TEST_EXIT_RANK, exit code).
# Agent mode: every rank exits 7 (a lone failure leaves the other agents in torch's 300 s exit barrier); per-rank
# mode: rank 2 dies of SIGKILL (hydra alone would report a bare 9).
AGENT_FAILS = {"pdsh": ("*:7", 7), "slurm": ("*:7", 7)}
PER_RANK_FAILS = {"openmpi": ("2:KILL", 128 + 9), "mpich": ("2:KILL", 128 + 9)}


@pytest.mark.parametrize("backend", params("pdsh", "openmpi", "mpich", "mvapich", "slurm"))
def test_agent_per_node_hostile_strings(backend: str, tmp_path: Path) -> None:
    hostile_launch(backend, tmp_path, OPTIONS.get(backend, {}), *AGENT_FAILS.get(backend, ()))


@pytest.mark.parametrize("backend", params("openmpi", "mpich", "slurm"))
def test_per_rank_mode_hostile_strings(backend: str, tmp_path: Path) -> None:
    hostile_launch(backend, tmp_path, {"per_rank": True}, *PER_RANK_FAILS.get(backend, ()))


CPU_REPORT = """import os, socket
out = os.environ["EZ_TEST_OUT"]
with open(os.path.join(out, "cpus-" + os.environ["RANK"]), "w") as f:
    f.write(socket.gethostname() + " " + os.environ.get("SLURM_CPUS_ON_NODE", "?"))
"""


@pytest.mark.slurm
def test_slurm_agent_step_holds_every_cpu_of_the_node(tmp_path: Path) -> None:
    """The agent and all its workers share one task: Slurm must give that task the node's CPUs, not one."""
    tb, hosts = bed("slurm")
    script = tmp_path / "cpu_report.py"
    script.write_text(CPU_REPORT)
    nodes = [[hosts[0], [0]], [hosts[1], [0]]]
    spec = make_spec(tb, "slurm", tmp_path, nodes=nodes, entry=[str(script)])
    p = launch(spec, tmp_path, timeout=180)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    out = Path(spec["env"]["EZ_TEST_OUT"])
    seen = sorted((out / f"cpus-{r}").read_text().split() for r in (0, 1))
    node_cpus = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--nodes={','.join(hosts)}", "--format=%N %c"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    expected = sorted(zip(node_cpus[::2], node_cpus[1::2], strict=True))
    assert [tuple(s) for s in seen] == [tuple(e) for e in expected]
    assert leftovers(spec["job_id"], tb) == {}
