"""A closed rendezvous stays closed for the agents still running; the last agent to leave removes the run's keys."""

from __future__ import annotations

import pytest
from rdzv_etcd_parts import join_all
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

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
    if h2._ez_release is not None:
        h2._ez_release()
