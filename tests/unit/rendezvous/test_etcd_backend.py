"""The etcd v3 state backend against a real etcd: create-if-absent, CAS on mod_revision, lease-bound state."""

from __future__ import annotations

import time

import pytest
from rdzv_etcd_parts import backend_for, client_for

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.etcd_lease import KeptLease

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def test_get_state_of_a_fresh_run_is_none(etcd_any: EtcdCluster) -> None:
    client = client_for(etcd_any)
    lease = KeptLease(client, 10)
    try:
        assert backend_for(client, lease).get_state() is None
    finally:
        lease.release()
        client.close()


def test_create_if_absent_then_cas(etcd_any: EtcdCluster) -> None:
    client = client_for(etcd_any)
    lease = KeptLease(client, 10)
    a, b = backend_for(client, lease), backend_for(client, lease)
    try:
        state, token, ok = a.set_state(b"one") or (b"", 0, False)
        assert (state, ok) == (b"one", True)
        # A second create-if-absent loses and gets the existing state and its token.
        assert b.set_state(b"two") == (b"one", token, False)
        # CAS with the right token wins and moves the token forward.
        state2, token2, ok2 = b.set_state(b"two", token) or (b"", 0, False)
        assert (state2, ok2) == (b"two", True) and token2 > token
        # The stale token loses; the caller learns the current state and token.
        assert a.set_state(b"three", token) == (b"two", token2, False)
        assert a.get_state() == (b"two", token2)
    finally:
        lease.release()
        client.close()


def test_cas_against_a_vanished_state_returns_none(etcd: EtcdCluster) -> None:
    client = client_for(etcd)
    lease = KeptLease(client, 10)
    backend = backend_for(client, lease)
    try:
        _, token, _ = backend.set_state(b"x") or (b"", 0, False)
        etcd.etcdctl("del", "/elasticzero/run/state")
        assert backend.set_state(b"y", token) is None
        assert backend.set_state(b"y", "not-an-etcd-token") is None
    finally:
        lease.release()
        client.close()


def test_state_is_bound_to_the_writers_lease(etcd: EtcdCluster) -> None:
    """Revoking (agent shut down) or letting the lease expire (agent died) removes the state."""
    client = client_for(etcd)
    lease = KeptLease(client, 10)
    backend = backend_for(client, lease)
    backend.set_state(b"alive")
    lease.release()
    assert backend.get_state() is None

    lease2 = KeptLease(client, 2)
    backend2 = backend_for(client, lease2)
    backend2.set_state(b"kept")
    time.sleep(3)  # the keep-alive thread keeps a 2 s lease going
    assert backend2.get_state() is not None
    lease2._stop.set()  # simulate a dead agent: no more keep-alives, no revoke
    lease2._thread.join(5)
    deadline = time.monotonic() + 10
    while backend2.get_state() is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert backend2.get_state() is None
    client.close()


def test_lost_lease_is_renewed_on_write(etcd: EtcdCluster) -> None:
    client = client_for(etcd)
    lease = KeptLease(client, 10)
    backend = backend_for(client, lease)
    try:
        old = lease.id
        client.revoke(old)
        assert backend.set_state(b"after-loss") is not None
        assert lease.id != old
        assert backend.get_state() is not None
    finally:
        lease.release()
        client.close()
