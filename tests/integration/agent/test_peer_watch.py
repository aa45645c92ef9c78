"""PeerWatch (the thin read of peer liveness) over torch's real rendezvous handlers: two nodes of one round on a real
TCPStore in this process; one stops its heartbeats (what a frozen agent looks like in the state). The other finds it
gone once its last heartbeat is older than the peer timeout — not before — and the silent one finds itself dropped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler

from elasticzero.agent.liveness import peer_plan
from elasticzero.agent.peers import PeerWatch
from ez_testing import free_port

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 3  # whole seconds: a 1 s heartbeat, dropped after 3


@pytest.fixture
def round_of_two() -> Iterator[tuple[DynamicRendezvousHandler, DynamicRendezvousHandler]]:
    store = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    plan = peer_plan(str(TIMEOUT), {}, torch_defaults=False)
    conf = {**plan.rdzv_conf(), "last_call_timeout": "1", "join_timeout": "60"}
    params = RendezvousParameters("c10d", "unused", "peer-watch", 2, 2, local_addr="127.0.0.1", **conf)
    handlers = [create_handler(store, C10dRendezvousBackend(store, "peer-watch"), params) for _ in range(2)]
    joins = [threading.Thread(target=h.next_rendezvous) for h in handlers]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)
    try:
        yield handlers[0], handlers[1]
    finally:
        for h in handlers:
            h._stop_heartbeats()


def test_a_silent_participant_is_gone_after_the_timeout_and_knows_it(
    round_of_two: tuple[DynamicRendezvousHandler, DynamicRendezvousHandler],
) -> None:
    a, b = round_of_two
    plan = peer_plan(str(TIMEOUT), {}, torch_defaults=False)
    watch_a, watch_b = PeerWatch(a, plan), PeerWatch(b, plan)
    assert watch_a.round_nodes == watch_b.round_nodes == {repr(a._this_node), repr(b._this_node)}
    for _ in range(20):  # two seconds of ticks: everyone alive
        assert watch_a.check().alive and watch_b.check().alive
        time.sleep(0.1)
    b._stop_heartbeats()  # b "freezes": its keep-alive thread writes no more
    t_stop = time.monotonic()
    verdict = watch_a.check()
    while verdict.alive and time.monotonic() - t_stop < 3 * TIMEOUT:
        time.sleep(0.1)
        verdict = watch_a.check()
    waited = time.monotonic() - t_stop
    print(f"b found gone {waited:.2f} s after its last heartbeat could be written")
    assert verdict.gone == (repr(b._this_node),) and not verdict.self_gone
    # its last heartbeat is at most one interval older than the stop, and a read every 0.5 s (etcd's period; c10d
    # reads every tick) sees the age pass the timeout: (timeout - interval, timeout + a read period + a tick]
    interval = plan.interval_s
    assert TIMEOUT - interval < waited <= TIMEOUT + 0.5 + 0.1 + 0.5, waited  # + 0.5: a loaded machine's thread start
    silent_b = watch_b.check()
    while not silent_b.self_gone and time.monotonic() - t_stop < 3 * TIMEOUT:
        time.sleep(0.1)
        silent_b = watch_b.check()
    assert silent_b.self_gone
