"""Real faults against real agents (each agent a separate process = a "node" on loopback).

worker SIGKILL → group restart, --max-restarts honoured; failure reaches idle nodes through the rendezvous;
root cause reported with its error file; a new agent joins → scale up; then that agent's SIGKILL → its workers die
(no orphans), survivors re-rendezvous at the smaller size (min nodes honoured).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from ez_agentkit import Cluster, alive, wait_for

from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(280)]


def start_nodes(cluster: Cluster, n: int, nnodes: str, **kw: object) -> str:
    """Start ``n`` agents with one worker each; the first hosts the store. Returns the endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    for i in range(n):
        health = cluster.tmp / f"health{len(cluster.agents)}.json"
        cluster.start(cluster.argv(endpoint, nnodes, nproc=1, health=health, **kw))  # type: ignore[arg-type]
        if i == 0:
            cluster.wait_store(endpoint)
    return endpoint


def running_world(cluster: Cluster, size: int, since: float, timeout: float) -> list[dict[str, object]]:
    return wait_for(
        lambda: (r := cluster.reports_since(since, size)) and len(r) == size and r,
        timeout,
        f"a world of {size} worker(s) after t={since:.1f}",
        cluster.agents,
    )


def test_worker_sigkill_restarts_group_until_max_restarts(cluster: Cluster) -> None:
    start_nodes(cluster, 2, "2", max_restarts=1, worker_opts=["loop=1"])
    first = running_world(cluster, 2, 0, 150)
    t_kill = time.time()
    os.kill(first[1]["pid"], signal.SIGKILL)  # type: ignore[arg-type]
    second = running_world(cluster, 2, t_kill, 120)
    recovery = max(r["time"] for r in second) - t_kill  # type: ignore[operator]
    print(f"worker SIGKILL -> both nodes' workers running again after {recovery:.1f}s")
    # the victim's node counts a retry; the other node may restart for the membership change (no retry) first
    assert "1" in {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in second}  # type: ignore[index]
    assert not any(alive(r["pid"]) for r in first)  # type: ignore[arg-type]
    # --max-restarts counts per agent: kill a worker of the agent that has used its one retry
    exhausted = next(r for r in second if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "1")  # type: ignore[index]
    os.kill(exhausted["pid"], signal.SIGKILL)  # type: ignore[arg-type]
    codes = [a.proc.wait(timeout=90) for a in cluster.agents]
    assert 128 + signal.SIGKILL in codes, codes  # that agent gives up with the root cause's exit status
    assert all(c != 0 for c in codes), codes  # the other one finds the rendezvous closed
    assert cluster.leftovers() == []


def test_failure_reaches_idle_node_via_rendezvous(cluster: Cluster) -> None:
    # workers do no collective: the healthy node learns of the failure only through the rendezvous
    start_nodes(cluster, 2, "2", max_restarts=1, worker_opts=["idle=1"])
    first = running_world(cluster, 2, 0, 150)
    t_kill = time.time()
    victim = next(r for r in first if r["env"]["GROUP_RANK"] == "1")  # type: ignore[index]
    os.kill(victim["pid"], signal.SIGKILL)  # type: ignore[arg-type]
    healthy = next(r for r in first if r is not victim)
    wait_for(lambda: not alive(healthy["pid"]), 30, "the healthy node to stop its worker", cluster.agents)  # type: ignore[arg-type]
    noticed = time.time() - t_kill
    print(f"healthy node stopped its idle worker {noticed:.1f}s after the other node's worker died")
    assert noticed < 15
    running_world(cluster, 2, t_kill, 120)
    (cluster.out / "stop").touch()
    assert [a.proc.wait(timeout=60) for a in cluster.agents] == [0, 0]


def test_root_cause_rank_and_error_file_reported(cluster: Cluster) -> None:
    logs = cluster.tmp / "logs"
    extra = ["--log-dir", str(logs), "--redirects", "3"]
    start_nodes(cluster, 2, "2", extra=extra, worker_opts=["loop=1", "fail_rank=1", "record=1"])
    codes = [a.proc.wait(timeout=150) for a in cluster.agents]
    failing = next(a for a in cluster.agents if "deliberate failure of rank 1" in a.output())
    assert codes[cluster.agents.index(failing)] == 1  # the exception's exit code
    line = next(x for x in failing.output().splitlines() if "root cause: rank 1" in x)
    error_file = logs / cluster.job_id / "rank1.attempt0.error.json"
    assert f"error file: {error_file}" in line and error_file.is_file()
    assert (
        "RuntimeError: deliberate failure of rank 1"
        in (logs / cluster.job_id / "rank1.attempt0.stderr.log").read_text()
    )
    assert all(c != 0 for c in codes), codes
    assert cluster.leftovers() == []


def test_min_nodes_honoured_when_too_few_survive(cluster: Cluster) -> None:
    # the survivor gives up after join_timeout without a second node; the first rendezvous must complete within it
    # too (both agents start at once: ~3 s to the join each, 4x that under load)
    conf = "join_timeout=12,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4,close_timeout=5"
    start_nodes(cluster, 2, "2:3", max_restarts=2, rdzv_conf=conf, worker_opts=["loop=1"])
    running_world(cluster, 2, 0, 150)
    t_kill = time.time()
    cluster.agents[1].proc.send_signal(signal.SIGKILL)
    code = cluster.agents[0].proc.wait(timeout=90)
    assert code != 0  # one node is below --nnodes 2:3's minimum: no world of 1 forms, the agent gives up
    assert cluster.reports_since(t_kill) == []
    assert cluster.leftovers() == []


def test_new_agent_joins_scale_up_then_its_sigkill_takes_its_workers_and_survivors_shrink(cluster: Cluster) -> None:
    # one job for both membership changes: a third agent joins a world of 2 (scale up), then that agent is SIGKILLed
    endpoint = start_nodes(cluster, 2, "2:3", max_restarts=2, worker_opts=["loop=1"])
    running_world(cluster, 2, 0, 150)
    t_join = time.time()
    cluster.start(cluster.argv(endpoint, "2:3", nproc=1, max_restarts=2, worker_opts=["loop=1"]))
    third = running_world(cluster, 3, t_join, 150)
    assert sorted(r["rank"] for r in third) == [0, 1, 2]
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in third} == {"0"}  # membership change is not a retry

    victim = cluster.agents[2]
    victim_workers = [r["pid"] for r in third if r["env"]["MASTER_ADDR"] and _child_of(r["pid"], victim.proc.pid)]  # type: ignore[arg-type]
    assert len(victim_workers) == 1
    t_kill = time.time()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    wait_for(lambda: not alive(victim_workers[0]), 5, "the killed agent's worker to die (PDEATHSIG)")  # type: ignore[arg-type]
    second = running_world(cluster, 2, t_kill, 120)
    recovery = max(r["time"] for r in second) - t_kill  # type: ignore[operator]
    print(f"agent SIGKILL -> survivors running at world size 2 after {recovery:.1f}s")
    (cluster.out / "stop").touch()
    assert [a.proc.wait(timeout=60) for a in cluster.agents[:2]] == [0, 0]
    assert cluster.leftovers() == []


def _child_of(pid: int, parent: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).ppid() == parent
    except psutil.Error:
        return False


def test_node_that_gives_up_stops_idle_peers(cluster: Cluster) -> None:
    # max-restarts 0: the failing node closes the run; the other node's workers never talk to it (idle)
    start_nodes(cluster, 2, "2", max_restarts=0, worker_opts=["idle=1"])
    first = running_world(cluster, 2, 0, 150)
    victim = next(r for r in first if r["env"]["GROUP_RANK"] == "1")  # type: ignore[index]
    os.kill(victim["pid"], signal.SIGKILL)  # type: ignore[arg-type]
    t_kill = time.monotonic()
    codes = [a.proc.wait(timeout=60) for a in cluster.agents]
    print(f"both agents exited {time.monotonic() - t_kill:.1f}s after the kill: {codes}")
    assert sorted(codes) == [1, 128 + signal.SIGKILL], codes
    assert any("closed by another node" in a.output() for a in cluster.agents)
    assert cluster.leftovers() == []
