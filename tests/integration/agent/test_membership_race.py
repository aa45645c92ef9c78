"""Membership changes are not failures, whatever the timing (real agents on loopback, ``--max-restarts 0``).

The race: when a node joins, one agent stops its worker for the membership change; a peer's worker dies in
``all_reduce`` and the peer may see that failure before it sees the waiting node. These tests force that order
instead of hoping for it: node 0's monitor loop is held (``ELASTICZERO_TEST_MONITOR_HOLD``, docs/agent.md) from
before the join until its worker has died. A graceful departure (SIGTERM to one agent) kills the others' workers
while nobody is waiting at all. With ``--max-restarts 0`` any spent restart would end the job.
"""

from __future__ import annotations

import signal
import time

import pytest
from ez_agentkit import Cluster, alive, wait_for
from test_faults import _child_of, running_world, start_nodes

from elasticzero.agent.plan import MONITOR_HOLD_ENV
from elasticzero.agent.tick import MEMBERSHIP_RESTART
from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(280)]
REJOINED = "re-joining, no restart spent"


def test_worker_dies_of_the_scale_up_before_its_agent_sees_the_joiner(cluster: Cluster) -> None:
    hold = cluster.tmp / "hold-node0"
    endpoint = f"127.0.0.1:{free_port()}"
    node0 = cluster.start(cluster.argv(endpoint, "2:3", nproc=1, worker_opts=["loop=1"]), {MONITOR_HOLD_ENV: str(hold)})
    cluster.wait_store(endpoint, timeout=150)
    cluster.start(cluster.argv(endpoint, "2:3", nproc=1, worker_opts=["loop=1"]))
    first = running_world(cluster, 2, 0, 150)
    worker0 = next(r["pid"] for r in first if _child_of(r["pid"], node0.proc.pid))
    hold.touch()
    wait_for(lambda: hold.with_name(hold.name + ".held").exists(), 30, "node 0's monitor to hold", cluster.agents)
    t_join = time.time()
    cluster.start(cluster.argv(endpoint, "2:3", nproc=1, worker_opts=["loop=1"]))
    # node 1 restarts for the joiner; node 0's worker dies in all_reduce while node 0 has not looked at the wait list
    wait_for(lambda: not alive(worker0), 150, "node 0's worker to die of node 1's restart", cluster.agents)
    hold.unlink()
    third = running_world(cluster, 3, t_join, 150)
    assert sorted(r["rank"] for r in third) == [0, 1, 2]
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in third} == {"0"}
    assert REJOINED in node0.output() and "waiting to join" in node0.output()
    (cluster.out / "stop").touch()
    assert [a.proc.wait(timeout=60) for a in cluster.agents] == [0, 0, 0]
    assert cluster.leftovers() == []


def test_node_leaving_on_sigterm_shrinks_the_job_without_a_failure(cluster: Cluster) -> None:
    start_nodes(cluster, 3, "2:3", worker_opts=["loop=1"])
    running_world(cluster, 3, 0, 180)
    t_leave = time.time()
    leaving = cluster.agents[2]
    leaving.proc.send_signal(signal.SIGTERM)
    assert leaving.proc.wait(timeout=60) == 128 + signal.SIGTERM
    second = running_world(cluster, 2, t_leave, 150)
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in second} == {"0"}
    # The first survivor to react can only see failed workers (nobody waits yet): it must re-join on the leaver's
    # mark. The other either does the same or, its worker still alive when the first one re-joins, restarts for a
    # waiting node (torch's ordinary path). Neither spends a restart.
    outputs = [a.output() for a in cluster.agents[:2]]
    assert any(REJOINED in o and "leaving on SIGTERM" in o for o in outputs), outputs
    assert all(REJOINED in o or f"{MEMBERSHIP_RESTART}; no restart spent" in o for o in outputs), outputs
    (cluster.out / "stop").touch()
    assert [a.proc.wait(timeout=60) for a in cluster.agents[:2]] == [0, 0]
    assert cluster.leftovers() == []
