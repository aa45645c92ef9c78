"""c10d keeps its rendezvous store inside one agent: when *that* node freezes (SIGSTOP of its agent and workers), the
other nodes cannot read any heartbeat, and cannot tell "the store's host froze" from "I am cut off". They must stop
their workers fast with one line naming the store, the cause, what they do and for how long — instead of hanging for
torch's 60 s store timeout and then the workers' collective timeout — and stay: when the store answers again (the
host resumes, a healed partition), they join again as new nodes and the job is back at its full size (issue 33)."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
from ez_agentkit import FAST_RDZV, Cluster, wait_for

from cluster.etcd_server import EtcdCluster, etcd  # noqa: F401  (the fixture)
from elasticzero.agent.liveness import DEFAULT_PEER_TIMEOUT_S
from elasticzero.agent.proctree import descendants
from ez_testing import free_port

# the waits below sum to well under the timeout, so a failed wait prints the agents' logs before pytest-timeout fires
pytestmark = [pytest.mark.multiproc, pytest.mark.clock, pytest.mark.timeout(240)]
REJOIN_S = 90


def test_the_store_hosts_freeze_stops_the_other_node_fast_and_it_rejoins(cluster: Cluster) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ["--rejoin-timeout", str(REJOIN_S)]
    argv = lambda: cluster.argv(endpoint, "1:2", nproc=1, rdzv_conf="", extra=extra, worker_opts=["loop=1"])  # noqa: E731
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
        workers = [p for p in other_tree if p.pid != other.proc.pid]
        wait_for(lambda: not [p for p in workers if _alive(p)], 30, "the cut-off node's workers stopped")
        print(f"the other agent said why {elapsed:.1f} s after the store host froze")
        out = other.output()
        assert "cannot survive its store host" in out and "etcd://" in out, out[-3000:]
        assert f"tries to join the rendezvous again as a new node for up to {REJOIN_S} s (--rejoin-timeout" in out
        assert out.count(line) == 1  # one line, not a line per tick or per try
        assert other.proc.poll() is None  # it stays
        assert elapsed < bound, out[-3000:]
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
    t_cont = time.time()
    # the host finds itself dropped (its heartbeat is as old as the freeze), the other's try reaches the store: both
    # join again as new nodes, and fresh workers train at world 2
    wait_for(lambda: len(cluster.reports_since(t_cont, world_size=2)) >= 2, 120, "world 2 again", cluster.agents)
    print(f"world 2 again {time.time() - t_cont:.1f} s after the store host resumed")
    (cluster.out / "stop").touch()
    assert host.proc.wait(timeout=60) == 0 and other.proc.wait(timeout=60) == 0, other.output()[-3000:]
    for agent in (host, other):
        assert _no_agent_traceback(agent.output()), agent.output()[-3000:]
    assert cluster.leftovers() == []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.etcd
def test_an_agent_cut_off_from_etcd_stays_and_rejoins(cluster: Cluster, etcd: EtcdCluster) -> None:  # noqa: F811
    """etcd lives outside the job; a node cut off from it (here: etcd frozen, one agent) fails the store call its
    client bounds (``retry_timeout``), stops its workers, tries again as a new node, and trains once etcd answers;
    cut off again, a SIGTERM between two tries stops it cleanly."""
    conf = f"{FAST_RDZV},retry_timeout=3,connect_timeout=2"
    extra = ["--rejoin-timeout", str(REJOIN_S)]
    argv = cluster.argv(etcd.endpoint(), "1:2", nproc=1, backend="elasticzero", rdzv_conf=conf, extra=extra)
    agent = cluster.start([*argv, "loop=1"])
    wait_for(lambda: cluster.reports(), 90, "a worker at world 1", cluster.agents)
    workers = [p for p in descendants([agent.proc.pid]) if p.pid != agent.proc.pid]
    server = etcd.members[0].proc
    assert server is not None
    server.send_signal(signal.SIGSTOP)
    try:
        line = f"tries to join the rendezvous again as a new node for up to {REJOIN_S} s (--rejoin-timeout"
        wait_for(lambda: line in agent.output(), 60, "the cut-off line", cluster.agents)
        wait_for(lambda: not [p for p in workers if _alive(p)], 30, "its workers stopped")
        assert agent.proc.poll() is None
    finally:
        server.send_signal(signal.SIGCONT)
    t_cont = time.time()
    wait_for(lambda: cluster.reports_since(t_cont), 90, "a fresh worker once etcd answers", cluster.agents)
    # cut off again (the clock starts anew), and stopped while it tries: one line, 128+SIGTERM, no traceback
    server.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: agent.output().count(line) == 2, 60, "the second cut-off line", cluster.agents)
        time.sleep(1.5)  # into its tries
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=60) == 128 + signal.SIGTERM, agent.output()[-3000:]
    finally:
        server.send_signal(signal.SIGCONT)
    out = agent.output()
    assert "elasticzero-run: stopped by SIGTERM" in out and _no_agent_traceback(out), out[-3000:]
    assert cluster.leftovers() == []


def _no_agent_traceback(output: str) -> bool:
    """No traceback of the agent's own (a worker's, prefixed ``[rankN]:``, dies of its peer's stop) and no
    exception from a finalizer."""
    return "Exception ignored" not in output and not any(x.startswith("Traceback") for x in output.splitlines())
