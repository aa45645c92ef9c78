"""The residual window of a c10d store host freeze: torch's monitor loop calls ``num_nodes_waiting`` (an unbounded
store read) right after the agent's bounded peer read answered. A store host frozen between the two must still end the
agent within the peer timeout, with the store line — not torch's 60 s store timeout and its error.

Real parts: a TCPStore served by a separate process (then SIGSTOPped), torch's c10d rendezvous backend and dynamic
handler over it; the freeze is placed exactly in the window (after a call that answered)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from elasticzero.agent.liveness import PeerPlan
from elasticzero.agent.peers import BoundedStoreHandler, StoreLostError, bound_store_calls

pytestmark = [pytest.mark.multiproc, pytest.mark.clock, pytest.mark.timeout(60)]

SERVE = "import sys, time; from torch.distributed import TCPStore; s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); print(s.port, flush=True); time.sleep(600)"  # noqa: E501
#: torch's own read timeout for the store client (its default is 60 s): the bound must not be this
STORE_TIMEOUT_S = 30


@pytest.fixture
def store_host() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def handler_on(port: int) -> DynamicRendezvousHandler:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    backend = C10dRendezvousBackend(store, "bound-test")
    return DynamicRendezvousHandler.from_backend("bound-test", store, backend, min_nodes=1, max_nodes=2)


def plan(timeout_s: int, store: str | None) -> PeerPlan:
    return PeerPlan(timeout_s, 1, timeout_s, "--peer-timeout", store)


def test_a_store_frozen_after_the_peer_read_ends_the_tick_within_the_peer_timeout(
    store_host: subprocess.Popen[str],
) -> None:
    assert store_host.stdout is not None
    port = int(store_host.stdout.readline())
    bounded = bound_store_calls(handler_on(port), plan(3, f"127.0.0.1:{port}"))
    assert isinstance(bounded, BoundedStoreHandler)
    assert bounded.num_nodes_waiting() == 0  # the store answers: the call passes through
    assert bounded.get_run_id() == "bound-test" and not bounded.is_closed()
    assert hasattr(bounded, "_heartbeat_lock")  # the peer watch reads torch's handler through it
    os.kill(store_host.pid, signal.SIGSTOP)
    time.sleep(1.1)  # past the state holder's 1 s cache: the next call goes to the (frozen) store
    start = time.monotonic()
    with pytest.raises(StoreLostError, match=rf"store at 127.0.0.1:{port} has not answered for 3\.\d s"):
        bounded.num_nodes_waiting()
    elapsed = time.monotonic() - start
    # the bound is the peer timeout; the thread start and the future's wake-up add milliseconds, and a loaded
    # machine up to a second: far below the store's own 30 s, the failure this replaces
    assert 3.0 <= elapsed < 3.0 + 1.0, elapsed


def test_etcd_and_a_local_store_keep_torchs_handler(store_host: subprocess.Popen[str]) -> None:
    assert store_host.stdout is not None
    handler = handler_on(int(store_host.stdout.readline()))
    assert bound_store_calls(handler, plan(4, None)) is handler  # etcd: no agent hosts the store
    assert bound_store_calls(handler, None) is handler  # peer liveness off (static rendezvous)


def test_a_store_this_process_hosts_is_no_peer(store_host: subprocess.Popen[str]) -> None:
    """The agent that hosts the c10d store (the first node; a single-node job's only one) never takes its own
    store's silence for a frozen host: a starved process would stop its own healthy job. Another process's store
    (``store_host``) is a peer's; one served here is not — torch's handler is kept, and the watch judges no store."""
    from elasticzero.agent.peers import PeerWatch, hosts_store

    assert store_host.stdout is not None
    theirs = int(store_host.stdout.readline())
    assert not hosts_store(f"127.0.0.1:{theirs}")
    here = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    own = f"127.0.0.1:{here.port}"
    assert hosts_store(own)
    handler = handler_on(here.port)
    assert bound_store_calls(handler, plan(3, own)) is handler
    watch = PeerWatch(handler, plan(3, own))
    assert watch.store_is_a_peer is False
    assert PeerWatch(handler, plan(3, f"127.0.0.1:{theirs}")).store_is_a_peer is True
