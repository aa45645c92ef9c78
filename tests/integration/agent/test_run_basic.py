"""elasticzero-run for real: one world from several agents, slot/core binding, worker env, --kill-job, bad input."""

from __future__ import annotations

import json
import subprocess

import pytest
from ez_agentkit import ELASTICZERO_RUN, Cluster, alive, wait_for

from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_one_agent_two_workers_bound_to_slots_and_cores(cluster: Cluster) -> None:
    # identity found by matching this host ("localhost" resolves to a local address); cores split per rank
    table = json.dumps([["localhost", [3, 5]]])
    logs = cluster.tmp / "logs"
    extra = ["--bind-cores-to-rank", "--log-dir", str(logs), "--tee", "1"]
    argv = cluster.argv(f"127.0.0.1:{free_port()}", "1", node_table=table, extra=extra)
    agent = cluster.start(argv)
    assert agent.proc.wait(timeout=150) == 0, agent.output()
    # per-rank log files: elasticzero-run uses the elasticzero logs spec by default (plain torchrun's entry point:
    # test_logs_specs.py)
    run_dir = logs / cluster.job_id
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["rank0.attempt0.stdout.log", "rank1.attempt0.stdout.log"]
    assert (run_dir / "rank1.attempt0.stdout.log").read_text().strip() == "hello from rank 1"
    assert "hello from rank 0" in agent.output()  # --tee 1: also on the agent's console
    reports = sorted(cluster.reports(), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in reports)
    for r in reports:
        env = r["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
        assert (env["LOCAL_RANK"], env["LOCAL_SIZE"]) == (str(r["rank"]), "2")
        assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("0", "1")
        assert env["ELASTICZERO_JOB_ID"] == cluster.job_id
    cpus = [r["cpus"] for r in reports]
    assert cpus[0] != cpus[1], cpus  # disjoint halves of this machine's cores
    assert all(r["env"]["OMP_NUM_THREADS"] == str(len(_expand(c))) for r, c in zip(reports, cpus, strict=True))


def test_two_agents_form_one_world(cluster: Cluster) -> None:
    """On torch's c10d rendezvous. The elasticzero rendezvous' two-agent world (the same node table and job, group
    ranks following it) is asserted by test_failure_propagation's success case, which runs that job anyway."""
    endpoint = f"127.0.0.1:{free_port()}"
    table = json.dumps([["127.0.0.1", [0]], ["localhost", [1]]])
    scratch = cluster.tmp / "scratch"  # the agents' $TMPDIR: what they leave there is seen below
    scratch.mkdir()
    for node_rank in (0, 1):
        argv = cluster.argv(endpoint, "2", node_table=table, identity=["--node-rank", str(node_rank)], backend="c10d")
        cluster.start(argv, env={"TMPDIR": str(scratch)})
    for a in cluster.agents:
        assert a.proc.wait(timeout=150) == 0, a.output()
    # no --log-dir: their logs folders (elasticzero-logs-<job>-<pid>, not torch's torchelastic_*) held no file and went
    # with the agents, as their progress records did
    assert sorted(p.name for p in scratch.iterdir()) == []
    reports = cluster.reports()
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in reports)
    assert sorted(r["env"]["CROSS_RANK"] for r in reports) == ["0", "1"]
    assert {r["env"]["CROSS_SIZE"] for r in reports} == {"2"}
    assert sorted(r["env"]["CUDA_VISIBLE_DEVICES"] for r in reports) == ["0", "1"]


def test_kill_job_stops_agent_workers_and_grandchildren(cluster: Cluster) -> None:
    health = cluster.tmp / "health.json"
    argv = cluster.argv(f"127.0.0.1:{free_port()}", "1", nproc=2, health=health, worker_opts=["loop=1", "grandchild=1"])
    agent = cluster.start(argv)
    wait_for(lambda: len(cluster.reports()) == 2, 120, "2 workers running", cluster.agents)
    pids = [r["pid"] for r in cluster.reports()] + [r["grandchild"] for r in cluster.reports()]
    assert all(alive(p) for p in pids)
    done = subprocess.run(
        [str(ELASTICZERO_RUN), "--kill-job", cluster.job_id, "--grace", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "signalled" in done.stderr
    agent.proc.wait(timeout=30)
    wait_for(lambda: not any(alive(p) for p in pids), 10, "workers and grandchildren gone")
    assert cluster.leftovers() == []


def test_kill_job_with_no_process_is_fine() -> None:
    done = subprocess.run(
        [str(ELASTICZERO_RUN), "--kill-job", "no-such-job-xyz"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    assert "signalled 0 process" in done.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--node-table", "[[", "--node-rank", "0"], "--node-table is not valid JSON"),
        (["--node-table", '[["nohost.invalid",[0]]]'], "is not in the node table"),
        (["--node-rank", "0", "--node-host-env", "SLURMD_NODENAME"], "contradict"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_started(cluster: Cluster, args: list[str], fragment: str) -> None:
    argv = [str(ELASTICZERO_RUN), "--rdzv-id", cluster.job_id, *args, "ez_agent_worker.py", str(cluster.out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elasticzero-run: error: ") and fragment in lines[0], done.stderr
    assert cluster.reports() == []


def _expand(cpus: str) -> list[int]:
    out: list[int] = []
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def test_failed_group_torn_down_with_grandchildren_and_health_file(cluster: Cluster) -> None:
    health = cluster.tmp / "health.json"
    opts = ["idle=1", "grandchild=1", "fail_rank=1", "fail_code=7"]
    argv = cluster.argv(f"127.0.0.1:{free_port()}", "1", nproc=2, health=health, worker_opts=opts)
    agent = cluster.start(argv)
    state = wait_for(lambda: (s := agent.state()) and s["state"] == "running" and s, 120, "health: running")
    assert state["agent_pid"] == agent.proc.pid and len(state["worker_pids"]) == 2 and state["world_size"] == 2
    assert agent.proc.wait(timeout=120) == 7  # the root-cause rank's exit code
    assert "root cause: rank 1" in agent.output()
    grandchildren = [r["grandchild"] for r in cluster.reports()]
    assert len(grandchildren) == 2 and not any(alive(p) for p in grandchildren)  # left the process group, still killed
    assert not health.exists()  # removed when the agent exits
    assert cluster.leftovers() == []
