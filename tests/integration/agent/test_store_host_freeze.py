"""c10d keeps its rendezvous store inside one agent: when *that* node freezes (SIGSTOP of its agent and workers), the
other nodes cannot read any heartbeat. They must fail fast with one line naming the store, the cause and the fix
(etcd), instead of hanging for torch's 60 s store timeout and then the workers' collective timeout."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
from ez_agentkit import Cluster, wait_for

from elasticzero.agent.liveness import DEFAULT_PEER_TIMEOUT_S
from elasticzero.agent.proctree import descendants
from ez_testing import free_port

# the waits below sum to well under the timeout, so a failed wait prints the agents' logs before pytest-timeout fires
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def test_the_store_hosts_freeze_ends_the_other_agent_fast_and_clearly(cluster: Cluster) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    argv = lambda: cluster.argv(endpoint, "1:2", nproc=1, rdzv_conf="", worker_opts=["loop=1"])  # noqa: E731
    host = cluster.start(argv())  # default rendezvous settings: the default peer timeout
    cluster.wait_store(endpoint)
    other = cluster.start(argv())
    # both workers at world 2 (the second agent may miss the first round: the first then runs alone at world 1 and
    # restarts its worker for the joiner, a third report)
    world2 = lambda: len([r for r in cluster.reports() if r["world_size"] == 2]) == 2  # noqa: E731
    wait_for(world2, 60, "a world of 2", cluster.agents)
    other_tree = descendants([other.proc.pid])
    frozen = descendants([host.proc.pid])
    t_freeze = time.monotonic()
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        # the silence reaches the peer timeout, then the agent stops a worker blocked in a collective (SIGTERM ends
        # it at once) and says so; the second timeout's worth is the margin for a loaded machine, far below torch's
        # 60 s store timeout (and the 300 s collective timeout behind it)
        bound = 2 * DEFAULT_PEER_TIMEOUT_S
        line = f"the c10d rendezvous store at {endpoint} has not answered for"
        wait_for(lambda: line in other.output(), bound + 30, "the store line", cluster.agents)
        elapsed = time.monotonic() - t_freeze
        code = other.proc.wait(timeout=30)  # then the interpreter's own exit (torch's teardown)
        print(f"the other agent said why {elapsed:.1f} s after the store host froze, exited {code} after "
              f"{time.monotonic() - t_freeze:.1f} s")  # fmt: skip
        out = other.output()
        assert code == 1 and line in out and "cannot survive its store host" in out and "etcd://" in out, out[-3000:]
        assert out.count(line) == 1  # one line, not a line per tick
        assert not [p for p in other_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # no orphans
        assert elapsed < bound, out[-3000:]
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
    (cluster.out / "stop").touch()
    host.proc.wait(timeout=60)  # alone now: its worker's peer is gone, it ends either way
    assert cluster.leftovers() == []
