"""Second round after the rank-0 node died: the survivors agree on the new master (torch alone keeps a stale one)."""

from __future__ import annotations

import pytest
from rdzv_etcd_parts import join_all
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters

from cluster.etcd_server import EtcdCluster
from elasticzero.agent.options import RDZV_DEFAULTS
from elasticzero.rendezvous.handler import create_rdzv_handler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]


def _master(info: RendezvousInfo) -> tuple[str, int]:
    return info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port


def test_survivors_follow_the_new_rank0_master(etcd: EtcdCluster) -> None:
    # elasticzero-run's keep-alive (1 s x 4): with 2 attempts a live node whose heartbeat is two intervals old right
    # after the round completed (torch's timer restarts after the join) was dropped as dead: 1 run in ~10 under I/O
    conf = {**RDZV_DEFAULTS, "last_call_timeout": "1", "lease_ttl": "10"}
    handlers = [
        create_rdzv_handler(RendezvousParameters("elasticzero", etcd.endpoint(), "rerdzv", 2, 3, local_addr=a, **conf))
        for a in ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    ]
    first = join_all(handlers, timeout=90)
    assert [i.rank for i in first] == [0, 1, 2]
    assert {_master(i) for i in first} == {_master(first[0])}
    assert _master(first[0])[0] == "127.0.0.1"

    dead, survivors = handlers[0], handlers[1:]
    dead._stop_heartbeats()  # the rank-0 node "dies": no more heartbeats, never rejoins
    second = join_all(survivors, timeout=90)
    assert [i.world_size for i in second] == [2, 2]
    assert [i.rank for i in second] == [0, 1]
    masters = {_master(i) for i in second}
    assert masters == {_master(second[0])}, f"survivors disagree on the master: {masters}"
    assert _master(second[0])[0] == "127.0.0.2"
    for h in survivors:
        assert h.shutdown()
    dead.release_backend()  # free the dead node's lease and connection
