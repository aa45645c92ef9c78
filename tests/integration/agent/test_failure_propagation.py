"""All-or-nothing exit across nodes, with real agents (2 processes on 127.0.0.1, one gloo worker each).

One node's workers fail with restarts exhausted while the other node's workers succeed: the succeeded node must not
sit in torch's exit barrier (300 s) but exit non-zero within seconds, whichever node hosts the store; the failing
node reports the root cause. Both succeed → both exit 0 promptly. Node 0 hosts the embedded store (``is_host``
from the node table), even when node 1 starts first.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from ez_agentkit import Cluster, wait_for

from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

#: the bound the brief sets for "promptly" on this loaded 2-core machine
PROMPT_S = 15.0
TABLE = json.dumps([["127.0.0.1", [0]], ["localhost", [1]]])  # distinct names, both this machine


def start(cluster: Cluster, endpoint: str, node_rank: int, worker_opts: list[str]) -> None:
    argv = cluster.argv(
        endpoint,
        "2",
        node_table=TABLE,
        identity=["--node-rank", str(node_rank)],
        backend="elasticzero",
        worker_opts=worker_opts,
    )
    cluster.start(argv)


def exits(cluster: Cluster, timeout: float) -> list[tuple[int, float]]:
    """Wait for every agent; return (exit code, wall-clock exit time) per agent, in start order."""
    done: dict[int, tuple[int, float]] = {}

    def all_done() -> bool:
        for i, a in enumerate(cluster.agents):
            if i not in done and (code := a.proc.poll()) is not None:
                done[i] = (code, time.time())
        return len(done) == len(cluster.agents)

    wait_for(all_done, timeout, "every agent to exit", cluster.agents)
    return [done[i] for i in range(len(cluster.agents))]


def listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("failing", [0, 1], ids=["store-host-fails", "client-fails"])
def test_partial_failure_ends_succeeded_node_promptly(cluster: Cluster, failing: int) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    # the failing rank waits 3 s after the all_reduce, so the other node's worker has succeeded and its agent is
    # in the exit barrier when the failure happens (the case that used to take exit_barrier_timeout = 300 s)
    opts = ["fail_rank=" + str(failing), "fail_code=3", "fail_delay=3"]
    for node_rank in (0, 1):
        start(cluster, endpoint, node_rank, opts)
        if node_rank == 0:
            cluster.wait_store(endpoint)
    (code_0, t_0), (code_1, t_1) = exits(cluster, 180)
    failed_at = float((cluster.out / f"failed_at.{failing}").read_text())
    codes = {0: code_0, 1: code_1}
    times = {0: t_0, 1: t_1}
    other = 1 - failing
    propagation = times[other] - failed_at
    print(f"worker of node {failing} failed; node {other}'s agent exited {propagation:.1f}s later, codes {codes}")
    failing_out, other_out = cluster.agents[failing].output(), cluster.agents[other].output()
    assert codes[failing] == 3, failing_out  # the root cause's exit code
    assert f"root cause: rank {failing} " in failing_out
    assert codes[other] == 1, other_out
    assert "job failed on another node" in other_out and f"root cause: rank {failing} " in other_out
    assert propagation < PROMPT_S, (propagation, other_out)
    assert times[failing] - failed_at < PROMPT_S, failing_out
    assert cluster.leftovers() == []


def test_success_both_exit_zero_promptly_and_node0_hosts_store(cluster: Cluster) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    start(cluster, endpoint, 1, [])  # node 1 first: with is_host=false it must not take the store
    time.sleep(3)
    assert not listening(endpoint), cluster.agents[0].output()
    assert cluster.agents[0].proc.poll() is None, cluster.agents[0].output()
    start(cluster, endpoint, 0, [])
    (code_1, t_1), (code_0, t_0) = exits(cluster, 180)
    print(f"both succeeded; exits {abs(t_1 - t_0):.1f}s apart")
    assert (code_0, code_1) == (0, 0), [a.output() for a in cluster.agents]
    assert abs(t_1 - t_0) < PROMPT_S
    # one world of the two agents, group ranks from the node table (node_rank_hint): the elasticzero rendezvous' case
    # of test_run_basic.test_two_agents_form_one_world, whose job this is
    reports = cluster.reports()
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in reports)
    assert sorted(r["env"]["CROSS_RANK"] for r in reports) == ["0", "1"]
    assert {r["env"]["CROSS_SIZE"] for r in reports} == {"2"}
    assert sorted(r["env"]["CUDA_VISIBLE_DEVICES"] for r in reports) == ["0", "1"]
    assert all(r["env"]["CROSS_RANK"] == r["env"]["CUDA_VISIBLE_DEVICES"] for r in reports)
    assert cluster.leftovers() == []
