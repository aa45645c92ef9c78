"""The prompt re-formation (``agent/prompt.py``) on elasticzero's etcd v3 rendezvous: a node that waits on the wait
list while the survivors re-form — expecting only each other — is taken into their round, not left for the next
(the state knows it: it heartbeats there). The crash case on torch's c10d rendezvous:
``tests/integration/agent/test_prompt_rendezvous.py``."""

from __future__ import annotations

import threading
import time

import pytest
from rdzv_etcd_parts import join_all
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters

from cluster.etcd_server import EtcdCluster
from elasticzero.agent.options import LIVE_RDZV_DEFAULTS
from elasticzero.agent.peers import READ_PERIOD_S
from elasticzero.agent.prompt import expect, make_prompt
from elasticzero.rendezvous.handler import ElasticZeroRendezvousHandler, create_rdzv_handler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]


def handler(etcd: EtcdCluster, addr: str) -> ElasticZeroRendezvousHandler:
    conf = {**LIVE_RDZV_DEFAULTS, "lease_ttl": "10"}  # elasticzero-run --live-recovery's rendezvous settings
    made = create_rdzv_handler(RendezvousParameters("elasticzero", etcd.endpoint(), "prompt", 1, 3, addr, **conf))
    assert make_prompt(made, READ_PERIOD_S)  # as elasticzero-run makes it under --live-recovery with etcd
    return made


def test_a_node_on_the_wait_list_is_taken_into_the_survivors_round(etcd: EtcdCluster) -> None:
    a, b = handler(etcd, "127.0.0.1"), handler(etcd, "127.0.0.2")
    assert [i.world_size for i in join_all([a, b], timeout=90)] == [2, 2]  # round 0: torch's last call (1 s)
    joiner = handler(etcd, "127.0.0.3")
    joined: list[RendezvousInfo] = []
    thread = threading.Thread(target=lambda: joined.append(joiner.next_rendezvous()), daemon=True)
    thread.start()  # the round is complete: the joiner waits on the wait list
    deadline = time.monotonic() + 60
    while a.num_nodes_waiting() == 0:  # what torch's agent loop polls before it re-rendezvouses
        assert time.monotonic() < deadline, "the joiner never reached the wait list"
        time.sleep(0.1)
    survivors = frozenset({repr(a._this_node), repr(b._this_node)})
    for h in (a, b):
        expect(h, survivors)  # the agents expect each other only; the joiner is known from the state
    assert [i.world_size for i in join_all([a, b], timeout=90)] == [3, 3]
    thread.join(60)
    assert [i.world_size for i in joined] == [3]
    assert sorted(repr(n) for n in a._state_holder.state.participants) == sorted([*survivors, repr(joiner._this_node)])
    for h in (a, b, joiner):
        assert h.shutdown()
