"""The prompt re-formation (``agent/prompt.py``) over torch's real c10d rendezvous: after a crash the survivors form
the next round as soon as both are in — not at the last call, set here to 60 s so that waiting it out would fail the
test. (A node on the wait list taken into the round: ``tests/integration/rendezvous/test_etcd_prompt.py``, on etcd.)

Real parts: a TCPStore, torch's ``C10dRendezvousBackend`` and ``DynamicRendezvousHandler`` for every node (in threads
of this process, and one in a subprocess that is SIGKILLed), the agent's :func:`drop_nodes` and :class:`PeerWatch`.
This is also the canary of the executor's behaviour inside torch's loop: the actions it returns are carried out by
torch's ``_DistributedRendezvousOpExecutor.run`` as its own."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from datetime import timedelta

import pytest
from c10d_nodes import in_thread, node_process
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from elasticzero.agent.liveness import PeerPlan
from elasticzero.agent.peers import PeerWatch, drop_nodes
from elasticzero.agent.prompt import PromptExecutor, expect, make_prompt

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

RUN_ID = "prompt-test"
#: waiting out this last call would take the test past its own timeout's half: a round formed before it formed early
LAST_CALL_S = 60
PEER_TIMEOUT_S = 60  # the heartbeat never drops the killed node here: the ask's drop does


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def prompt_handler(port: int, last_call_s: float = LAST_CALL_S) -> DynamicRendezvousHandler:
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    handler = DynamicRendezvousHandler.from_backend(
        RUN_ID, client, C10dRendezvousBackend(client, RUN_ID), 1, 3,
        timeout=RendezvousTimeout(last_call=timedelta(seconds=last_call_s)),
        keep_alive_interval=1, keep_alive_max_attempt=PEER_TIMEOUT_S,
    )  # fmt: skip
    assert make_prompt(handler, 0.1)
    return handler


@pytest.fixture
def killed_node(store: TCPStore) -> Iterator[subprocess.Popen[str]]:
    with node_process(store.port, RUN_ID, 3, LAST_CALL_S, PEER_TIMEOUT_S) as proc:
        yield proc


def watch(handler: DynamicRendezvousHandler, port: int) -> PeerWatch:
    w = PeerWatch(handler, PeerPlan(PEER_TIMEOUT_S, 1, PEER_TIMEOUT_S, "--peer-timeout", f"127.0.0.1:{port}"))
    w.check()  # one answered read: the heartbeats as they are now
    return w


def test_after_a_crash_the_survivors_form_the_next_round_without_waiting_out_the_last_call(
    store: TCPStore, killed_node: subprocess.Popen[str]
) -> None:
    a, b = prompt_handler(store.port), prompt_handler(store.port)
    got_b = in_thread(b.next_rendezvous)
    first = a.next_rendezvous()  # the killed node is the third: max_nodes, so round 0 completes at once
    assert first.world_size == 3 and got_b().world_size == 3
    assert killed_node.stdout is not None
    dead = killed_node.stdout.readline().strip()
    os.kill(killed_node.pid, signal.SIGKILL)
    killed_node.wait()
    watch_a, watch_b = watch(a, store.port), watch(b, store.port)
    assert drop_nodes(a, (dead,), watch_a.this_node)  # the ask's verdict (agent/suspicion.py), as the asker lands it
    expect(a, watch_a.alive((dead,)))
    expect(b, watch_b.alive((dead,)))
    assert watch_a.alive((dead,)) == {watch_a.this_node, watch_b.this_node}
    got_b = in_thread(b.next_rendezvous, LAST_CALL_S / 2)
    again = in_thread(a.next_rendezvous, LAST_CALL_S / 2)()
    assert (again.world_size, got_b().world_size) == (2, 2)
    assert {again.rank, b._get_world()[0]} == {0, 1}
    assert all(h._op_executor.expected is None for h in (a, b))  # one join's expectation, spent
    for h in (a, b):
        h.shutdown()


def test_only_torchs_own_handler_is_made_prompt() -> None:
    class Other:
        pass

    assert not make_prompt(Other(), 0.1)
    expect(Other(), frozenset())  # no executor of ours: nothing to tell, nothing raised
    assert PromptExecutor.__mro__[1].__name__ == "_DistributedRendezvousOpExecutor"
