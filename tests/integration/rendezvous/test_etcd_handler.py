"""The ``elasticzero`` handler on a real etcd, in process: three nodes (threads), hints, master consistency."""

from __future__ import annotations

import pytest
from rdzv_etcd_parts import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.handler import create_rdzv_handler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def test_hints_order_ranks_and_rank0_is_the_master(etcd: EtcdCluster) -> None:
    addrs, hints = ["127.0.0.1", "127.0.0.2", "127.0.0.3"], [1, None, 0]
    handlers = []
    for addr, hint in zip(addrs, hints, strict=True):
        conf = {} if hint is None else {"node_rank_hint": str(hint)}
        params = RendezvousParameters("elasticzero", etcd.endpoint(), "hints", 3, 3, local_addr=addr, **conf)
        handlers.append(create_rdzv_handler(params))
    infos = join_all(handlers)
    # torch alone would rank by address (.1, .2, .3); the hints put .3 first, .1 second, the unhinted .2 last.
    assert [i.rank for i in infos] == [1, 2, 0]
    assert {i.world_size for i in infos} == {3}
    masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert masters == {("127.0.0.3", infos[2].bootstrap_store_info.master_port)}
    assert all(h.shutdown() for h in handlers)
    assert etcd.etcdctl("get", "--prefix", "--keys-only", "/elasticzero/hints/").strip() == ""
