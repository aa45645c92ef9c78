"""The etcd v3 torch Store against a real etcd: the semantics torch's agent and PrefixStore rely on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import grpc
import pytest
import torch.distributed as dist
from rdzv_etcd_parts import leased_client, store_for

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.etcd_store import EtcdStore

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


@pytest.fixture
def store(etcd_any: EtcdCluster) -> object:
    with leased_client(etcd_any) as (client, lease):
        yield store_for(client, lease)


def _second(store: EtcdStore) -> EtcdStore:
    return store_for(store._client, store._lease)


def test_set_get_check_delete_num_keys(store: EtcdStore) -> None:
    assert not store.check(["a"])
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\xff"
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 1


def test_add_is_atomic_across_threads(store: EtcdStore) -> None:
    assert store.add("n", 5) == 5

    def bump() -> None:
        for _ in range(10):
            store.add("n", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.add("n", 0) == 45
    assert store.get("n") == b"45"


def test_compare_set_follows_tcpstore(store: EtcdStore) -> None:
    assert store.compare_set("k", "x", "y") == b"x"  # missing key, non-empty expected: unchanged
    assert not store.check(["k"])
    assert store.compare_set("k", "", "v1") == b"v1"  # missing key, empty expected: created
    assert store.compare_set("k", "wrong", "v2") == b"v1"
    assert store.compare_set("k", "v1", "v2") == b"v2"
    store.set("e", "")
    assert store.compare_set("e", "", "filled") == b"filled"


def test_multi_set_and_multi_get(store: EtcdStore) -> None:
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``call`` in a thread (returns once it is about to call); the list gets its result or exception."""
    started, out = threading.Event(), []

    def run() -> None:
        started.set()
        try:
            out.append(call())
        except Exception as exc:  # reported by the caller's assertion
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    return t, out


def test_wait_wakes_on_a_put_from_another_client(store: EtcdStore) -> None:
    t, out = _in_thread(lambda: store.wait(["late"], timedelta(seconds=60)))
    _second(store).set("late", "here")
    t.join(60)
    assert out == [None]  # woken by the put, long before its 60 s timeout
    assert store.get("late") == b"here"  # a blocking get returns at once now


def test_get_blocks_until_set(store: EtcdStore) -> None:
    t, out = _in_thread(lambda: store.get("g"))
    store.set("g", "v")
    t.join(60)
    assert out == [b"v"]


def test_wait_times_out_with_dist_store_error(store: EtcdStore) -> None:
    with pytest.raises(dist.DistStoreError, match=r"timeout after 1000ms, keys: never"):
        store.wait(["never"], timedelta(seconds=1))


def test_get_honours_the_store_timeout(etcd: EtcdCluster) -> None:
    with leased_client(etcd) as (client, lease):
        short = store_for(client, lease, timeout=1)
        with pytest.raises(dist.DistStoreError, match=r"timeout after 1000ms, keys: missing"):
            short.get("missing")


def test_multi_get_waits_for_the_last_of_several_keys(store: EtcdStore) -> None:
    other = _second(store)
    store.set("m1", "a")
    t, out = _in_thread(lambda: store.multi_get(["m1", "m2", "m3"]))
    other.set("m3", "c")
    assert not store.check(["m2"])  # the reader cannot have all three yet
    other.set("m2", "b")
    t.join(60)
    assert out == [[b"a", b"b", b"c"]]


def test_through_torch_prefix_store_as_the_agent_uses_it(store: EtcdStore) -> None:
    prefixed = dist.PrefixStore("torch.rendezvous.run.0", store)
    prefixed.set("MASTER_ADDR", "127.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"127.0.0.1"
    prefixed.multi_set(["torchelastic/assigned_ranks/0"], ["[0, 1, 0, 1]"])
    assert prefixed.multi_get(["torchelastic/assigned_ranks/0"]) == [b"[0, 1, 0, 1]"]
    assert prefixed.add("barrier/num", 1) == 1
    prefixed.wait(["MASTER_ADDR"])
    assert store.get("torch.rendezvous.run.0/MASTER_ADDR") == b"127.0.0.1"


class _LostAnswer(grpc.RpcError):
    """What grpc raises when the deadline passes before etcd's answer arrives."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


def test_add_counts_once_when_the_committed_answer_is_lost(store: EtcdStore) -> None:
    """The first Txn commits but its answer is lost (DEADLINE_EXCEEDED): the client's retry must not add again."""
    assert store.add("n", 1) == 1
    client = store._client
    ep = client._endpoints[client._current]
    real_kv, lost = ep.kv, []

    class _Kv:
        def __getattr__(self, name: str) -> object:
            return getattr(real_kv, name)

        def Txn(self, req: object, **kw: object) -> object:
            resp = real_kv.Txn(req, **kw)
            if not lost and resp.succeeded:
                lost.append(resp)
                raise _LostAnswer()
            return resp

    ep.kv = _Kv()
    try:
        assert store.add("n", 5) == 6
    finally:
        ep.kv = real_kv
    assert lost, "the injected failure did not happen"
    assert store.get("n") == b"6"
    assert store.add("n", 0) == 6
    assert client.range(b"/elasticzero/run/ops/", b"/elasticzero/run/ops0").count == 0  # markers are removed
