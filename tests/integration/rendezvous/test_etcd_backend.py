"""The etcd v3 state backend against a real etcd: create-if-absent, CAS on mod_revision, a lease-less state."""

from __future__ import annotations

import threading

import pytest
from rdzv_etcd_parts import backend_for, client_for, leased_client, store_for

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.etcd_client import EtcdConnectionError
from elasticzero.rendezvous.etcd_lease import KeptLease

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def test_get_state_of_a_fresh_run_is_none(etcd_any: EtcdCluster) -> None:
    with leased_client(etcd_any) as (client, _lease):
        assert backend_for(client).get_state() is None


def test_create_if_absent_then_cas(etcd_any: EtcdCluster) -> None:
    with leased_client(etcd_any) as (client, _lease):
        a, b = backend_for(client), backend_for(client)
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


def test_cas_against_a_vanished_state_returns_none(etcd: EtcdCluster) -> None:
    with leased_client(etcd) as (client, _lease):
        backend = backend_for(client)
        _, token, _ = backend.set_state(b"x") or (b"", 0, False)
        etcd.etcdctl("del", "/elasticzero/run/state")
        assert backend.set_state(b"y", token) is None
        assert backend.set_state(b"y", "not-an-etcd-token") is None


def test_state_outlives_the_writers_lease(etcd: EtcdCluster) -> None:
    """The state has no lease: an agent that closes the rendezvous and revokes its lease leaves "closed" behind."""
    client = client_for(etcd)
    lease = KeptLease(client, 10)
    backend = backend_for(client)
    try:
        backend.set_state(b"closed")
        lease.release()
        assert backend.get_state() is not None
        assert etcd.etcdctl("get", "--write-out=fields", "/elasticzero/run/state").count('"Lease" : 0') == 1
    finally:
        client.close()


def test_lost_lease_is_renewed_on_write(etcd: EtcdCluster) -> None:
    """``add`` puts its idempotency marker on the agent's lease: a lost lease is replaced and the add applied once."""
    with leased_client(etcd) as (client, lease):
        store = store_for(client, lease)
        old = lease.id
        client.revoke(old)
        assert store.add("k", 2) == 2
        assert lease.id != old
        assert store.get("k") == b"2"


def test_store_keys_have_no_lease(etcd: EtcdCluster) -> None:
    """Store keys outlive their writer (TCPStore's contract); only the run's clean-up removes them."""
    with leased_client(etcd) as (client, lease):
        store = store_for(client, lease)
        store.set("a", "1")
        store.multi_set(["b"], ["2"])
        store.add("c", 1)
        store.compare_set("d", "", "4")
        lease.release()
        assert [store.get(k) for k in "abcd"] == [b"1", b"2", b"1", b"4"]
        for k in "abcd":
            fields = etcd.etcdctl("get", "--write-out=fields", f"/elasticzero/run/store/{k}")
            assert fields.count('"Lease" : 0') == 1, fields


def test_renew_callbacks_that_failed_are_run_again_by_the_keep_alive_thread(etcd: EtcdCluster) -> None:
    """A member key that could not be re-registered right after a renewal is registered by a later keep-alive."""
    with leased_client(etcd, ttl=2) as (client, lease):
        calls: list[int] = []
        keep_alives_after: list[int] = []
        succeeded, two_more_keep_alives = threading.Event(), threading.Event()
        real_keep_alive = client.keep_alive_once

        def flaky(lease_id: int) -> None:
            calls.append(lease_id)
            if len(calls) == 1:
                raise EtcdConnectionError("etcd flapped")
            succeeded.set()

        def counting_keep_alive(lease_id: int, **kw: object) -> int:
            ttl = real_keep_alive(lease_id, **kw)
            if succeeded.is_set():
                keep_alives_after.append(lease_id)
                if len(keep_alives_after) >= 2:
                    two_more_keep_alives.set()
            return ttl

        client.keep_alive_once = counting_keep_alive  # type: ignore[method-assign]
        lease.on_renew(flaky)
        old = lease.id
        client.revoke(old)
        with pytest.raises(EtcdConnectionError):
            lease.renew(old)
        new = lease.id
        assert new != old
        assert succeeded.wait(30)  # the keep-alive thread ran the failed callback again
        assert calls[:2] == [new, new]
        assert two_more_keep_alives.wait(30)  # two more keep-alive rounds after that success ...
        assert len(calls) == 2  # ... and no further callback calls
