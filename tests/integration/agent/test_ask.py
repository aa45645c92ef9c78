"""A failed collective's ask (``agent/suspicion.py``) over torch's real c10d rendezvous: a live node that is asked
answers and is kept; a node SIGKILLed is silent, dropped by one compare-and-set on torch's state, and torch's own
rendezvous then forms the next round without it — long before its heartbeat could age past the peer timeout.

Real parts: a TCPStore, torch's ``C10dRendezvousBackend`` and ``DynamicRendezvousHandler`` for every node (two in this
process, or one in a subprocess that is SIGKILLed), the agent's :class:`PeerWatch` on each round's store, and
:func:`~elasticzero.agent.tick.decide` over the facts the watch reads."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from c10d_nodes import in_thread, node_process
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from elasticzero.agent.liveness import PeerPlan
from elasticzero.agent.peers import PeerWatch, drop_nodes
from elasticzero.agent.tick import AskPeers, Change, Facts, HandOff, Workers, decide

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

#: the heartbeat timeout is long on purpose: a round that forms without the killed node forms because of the drop
PEER_TIMEOUT_S = 60
RUN_ID = "ask-test"


def plan(port: int) -> PeerPlan:
    return PeerPlan(PEER_TIMEOUT_S, 1, PEER_TIMEOUT_S, "--peer-timeout", f"127.0.0.1:{port}")


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def handler_on(port: int) -> DynamicRendezvousHandler:
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    return DynamicRendezvousHandler.from_backend(
        RUN_ID, client, C10dRendezvousBackend(client, RUN_ID), 1, 2,
        timeout=RendezvousTimeout(last_call=timedelta(seconds=2)),
        keep_alive_interval=1, keep_alive_max_attempt=PEER_TIMEOUT_S,
    )  # fmt: skip


def read(watch: PeerWatch) -> None:
    """One tick's read of the state and the round's asks, waited for (a c10d watch waits for its read)."""
    watch.check()


def suspicion_facts(watch: PeerWatch, reported: bool) -> Facts:
    read(watch)
    return Facts(Workers.HEALTHY, live=True, peers=watch.plan, suspicion=watch.suspicion(reported))


@pytest.fixture
def killed_node(store: TCPStore) -> Iterator[subprocess.Popen[str]]:
    with node_process(store.port, RUN_ID, 2, 2, PEER_TIMEOUT_S) as proc:
        yield proc


def test_an_asked_live_node_answers_and_nobody_is_dropped(store: TCPStore) -> None:
    a, b = handler_on(store.port), handler_on(store.port)
    got_b = in_thread(b.next_rendezvous)
    info_a, info_b = a.next_rendezvous(), got_b()
    watch_a = PeerWatch(a, plan(store.port), info_a.store)
    watch_b = PeerWatch(b, plan(store.port), info_b.store)
    assert decide(suspicion_facts(watch_a, reported=True)) == AskPeers()
    assert watch_a.ask() == watch_a.this_node
    assert watch_b.ask() == watch_a.this_node  # both workers failed: the first asker wins, the other is asked
    asked = decide(suspicion_facts(watch_b, reported=True))
    assert asked == HandOff(Change.PEER_ASKED, None, asked.why, answer=True) and watch_a.this_node in asked.why
    watch_b.answer()
    verdict = decide(suspicion_facts(watch_a, reported=True))
    assert isinstance(verdict, HandOff) and verdict.change is Change.CONNECTION_LOST and verdict.drop == ()
    for h in (a, b):
        h.shutdown()


def test_a_killed_node_is_silent_dropped_and_the_next_round_forms_without_it(
    store: TCPStore, killed_node: subprocess.Popen[str]
) -> None:
    a = handler_on(store.port)
    info_a = a.next_rendezvous()
    assert killed_node.stdout is not None
    b_node = killed_node.stdout.readline().strip()
    assert info_a.world_size == 2, "both nodes in the first round"
    os.kill(killed_node.pid, signal.SIGKILL)
    killed_node.wait()
    watch = PeerWatch(a, plan(store.port), info_a.store)
    assert watch.ask() == watch.this_node
    deadline = time.monotonic() + 10 * watch.ask_timeout_s
    while not isinstance(action := decide(suspicion_facts(watch, reported=True)), HandOff):
        assert time.monotonic() < deadline, f"no verdict: {action}"
        time.sleep(0.05)
    assert action.change is Change.PEER_CRASHED and action.drop == (b_node,), action
    assert drop_nodes(a, action.drop, watch.this_node)
    read(watch)
    assert watch.check().gone == (b_node,)  # the watch's own rule agrees: the heartbeat is the epoch
    again = a.next_rendezvous()  # torch's rule drops the expired node: a round of one forms (min 1, last call 2 s)
    assert again.world_size == 1 and again.rank == 0
    assert not drop_nodes(a, action.drop, watch.this_node)  # gone from the state: nothing to expire
    assert not drop_nodes(a, (watch.this_node,), b_node)  # the dropped node (in a stale view) drops nobody
    assert watch.this_node in {repr(n) for n in a._state_holder.state.last_heartbeats}
    a.shutdown()
