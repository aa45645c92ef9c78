"""A closed rendezvous stays closed for the agents still running; the last agent to leave removes the run's keys."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from rdzv_etcd_parts import join_all
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.utils.store import barrier

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.etcd_store import EtcdStore
from elasticzero.rendezvous.handler import ElasticZeroRendezvousHandler, create_rdzv_handler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

CONF = {"keep_alive_interval": "1", "last_call_timeout": "1", "join_timeout": "30", "lease_ttl": "10"}


def _handlers(etcd: EtcdCluster, run_id: str, n: int = 2, **conf: str) -> list[ElasticZeroRendezvousHandler]:
    return [
        create_rdzv_handler(
            RendezvousParameters(
                "elasticzero", etcd.endpoint(), run_id, n, n, local_addr=f"127.0.0.{i + 1}", **{**CONF, **conf}
            )
        )
        for i in range(n)
    ]


def _keys(etcd: EtcdCluster, run_id: str) -> str:
    return etcd.etcdctl("get", "--prefix", "--keys-only", f"/elasticzero/{run_id}/").strip()


def test_closed_by_one_agent_is_seen_by_the_other_then_nothing_is_left(etcd: EtcdCluster) -> None:
    # join_timeout (600 s) is far beyond this test's timeout: B must learn that the run is closed without it
    a, b = _handlers(etcd, "closed", join_timeout="600")
    assert [i.world_size for i in join_all([a, b])] == [2, 2]
    assert a.shutdown()  # node A gave up (restarts exhausted): it closes the rendezvous and exits
    assert "/elasticzero/closed/state" in _keys(etcd, "closed")  # B is still there: the closed state is kept
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()  # B re-joins: it must learn at once that the run is over, not wait join_timeout
    assert b.shutdown()
    assert _keys(etcd, "closed") == ""  # the last agent to leave removed the run's keys


def test_a_key_outlives_the_agent_that_wrote_it(etcd: EtcdCluster) -> None:
    """TCPStore's contract: a key stays until deleted, whoever wrote it and whether that client is still there."""
    a, b = _handlers(etcd, "outlive")
    info_a, info_b = join_all([a, b])
    info_a.store.set("flag", "1")
    assert a.shutdown()  # A leaves: its member key and lease go, its Store keys stay for B
    assert info_b.store.get("flag") == b"1"
    assert b.shutdown()
    assert _keys(etcd, "outlive") == ""  # the last agent to leave still removes everything


class _LateWaiter(dist.Store):
    """B's side of torch's exit barrier, unchanged, except that ``added`` is set once B has counted itself in and its
    wait starts only once ``go`` is set."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner, self.added, self.go = inner, threading.Event(), threading.Event()

    def add(self, key: str, amount: int) -> int:
        try:
            return self._inner.add(key, amount)
        finally:
            self.added.set()

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.go.wait()
        self._inner.wait(keys, timedelta(seconds=10))


def test_exit_barrier_passes_when_the_last_agent_to_arrive_leaves_at_once(etcd: EtcdCluster) -> None:
    """torch's exit barrier: the last agent to arrive sets the done flag and shuts down at once; an agent that arrived
    earlier but reads the flag only after that must still pass (it used to wait out the 300 s barrier timeout)."""
    a, b = _handlers(etcd, "exitbar")
    info_a, info_b = join_all([a, b])
    late, failed = _LateWaiter(info_b.store), []

    def b_barrier() -> None:
        try:
            barrier(late, 2, "exit", barrier_timeout=30)
        except Exception as exc:  # reported below
            failed.append(exc)

    t = threading.Thread(target=b_barrier)
    t.start()
    assert late.added.wait(30)
    barrier(info_a.store, 2, "exit", barrier_timeout=30)  # A arrives last: it sets the done flag and passes at once
    assert a.shutdown()
    late.go.set()
    t.join(30)
    assert not t.is_alive() and not failed, failed
    assert b.shutdown()


def test_a_run_abandoned_by_dead_agents_is_wiped_by_the_next_agent(etcd: EtcdCluster) -> None:
    """Every agent died (no clean shutdown): the lease-less state stays until an agent of that run id comes back."""
    etcd.etcdctl("put", "/elasticzero/abandoned/state", "stale-pickle")
    etcd.etcdctl("put", "/elasticzero/abandoned/store/torch.rendezvous.abandoned.0/x", "stale")
    (a,) = _handlers(etcd, "abandoned", n=1)
    try:
        assert "stale" not in etcd.etcdctl("get", "--prefix", "/elasticzero/abandoned/")
        assert join_all([a])[0].world_size == 1
    finally:
        assert a.shutdown()
    assert _keys(etcd, "abandoned") == ""


def test_member_key_is_registered_again_after_a_lost_lease(etcd: EtcdCluster) -> None:
    """A lease lost in an outage must not make the agent look gone (the next agent would wipe a live run)."""
    a, b = _handlers(etcd, "relost")
    join_all([a, b])
    store = a._store
    assert isinstance(store, EtcdStore)
    old = store._lease.id
    store._client.revoke(old)  # as if the lease expired during an outage
    assert store._lease.renew(old) != old
    members = etcd.etcdctl("get", "--prefix", "--keys-only", "/elasticzero/relost/members/").split()
    assert f"/elasticzero/relost/members/{store._lease.id:x}" in members
    assert len(members) == 2
    assert a.shutdown() and b.shutdown()
    assert _keys(etcd, "relost") == ""


def test_a_second_round_0_with_other_nodes_is_ordered_again(etcd: EtcdCluster) -> None:
    """The rank cache is keyed by (round, participants): round 0 of a wiped run is not round 0 of the old one."""

    def handler(addr: str, hint: int | None) -> ElasticZeroRendezvousHandler:
        conf = dict(CONF) if hint is None else {**CONF, "node_rank_hint": str(hint)}
        return create_rdzv_handler(RendezvousParameters("elasticzero", etcd.endpoint(), "again", 2, 2, addr, **conf))

    h1, h2 = handler("127.0.0.1", 1), handler("127.0.0.2", 0)
    assert [i.rank for i in join_all([h1, h2])] == [1, 0]
    h2._stop_heartbeats()
    etcd.etcdctl("del", "--prefix", "/elasticzero/again/")  # the run's keys are gone (operator, or wiped)
    h3 = handler("127.0.0.3", None)
    second = join_all([h1, h3])
    assert [i.rank for i in second] == [0, 1]  # a stale cache would give h1 its old rank 1 as well
    assert h1.shutdown() and h3.shutdown()
    h2.release_backend()
