"""torch's Store contract, run on the etcd store and on TCPStore (the reference), both through ``PrefixStore``.

``rdzv_info.store`` is a ``PrefixStore`` over the backend's store, so every call torch's agent and a user's script
make goes through torch's C++ trampoline, not straight to the Python methods: this is the path tested here. The
cases follow the ``StoreTestBase`` contract of torch's test/distributed/test_store.py (set/get/add/check,
compare_set, wait with a timeout, num_keys/delete_key, the extended API, clone) and the timeout messages of
TCPStore; each runs unchanged on both stores, so a difference between ours and torch's reference is a failure.
"""

from __future__ import annotations

import gc
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from rdzv_etcd_parts import join_all, leased_client, store_for
from torch.distributed.elastic.rendezvous import RendezvousParameters

from cluster.etcd_server import EtcdCluster, require_etcd
from elasticzero.rendezvous.etcd_store import EtcdStore
from elasticzero.rendezvous.handler import create_rdzv_handler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

DEFAULT = timedelta(seconds=30)  # the stores' default timeout: no case may wait for it


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd 3.4 for the module; each case has its own run prefix."""
    cluster = EtcdCluster.start(tmp_path_factory.mktemp("conformance") / "etcd", 1, require_etcd("3.4"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["tcp", "etcd"])
def make_base(request: pytest.FixtureRequest) -> Iterator[Callable[[], dist.Store]]:
    """A factory of fresh underlying stores of one kind (the same run/server for every call within a case)."""
    if request.param == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=DEFAULT)
        yield lambda: server
        return
    cluster: EtcdCluster = request.getfixturevalue("etcd_server")
    # A Python store must outlive its C++ wrappers (pybind11 keeps only the C++ half alive), as the handler's does.
    alive: list[EtcdStore] = []

    def make() -> EtcdStore:
        alive.append(store_for(client, lease, run=run, timeout=DEFAULT.total_seconds()))
        return alive[-1]

    with leased_client(cluster) as (client, lease):
        run = uuid.uuid4().hex
        yield make


@pytest.fixture
def store(make_base: Callable[[], dist.Store]) -> dist.Store:
    """The store as torch hands it out: wrapped in a ``PrefixStore``."""
    return dist.PrefixStore("torch.rendezvous.run.0", make_base())


def _timeout_error(ms: int, key: str) -> str:
    """TCPStore's message shape: the timeout asked for, and the key (with its prefixes)."""
    return rf"timeout after {ms}ms, keys: \S*{re.escape(key)}"


def test_set_get_add_check_and_key_count(store: dist.Store) -> None:
    before = store.num_keys()  # TCPStore holds an init key of its own
    for amount in (1, 2, 3):
        store.add("key", amount)
    store.set("key0", "value0")
    store.set("key1", b"value1")
    store.set("key2", bytearray(b"\x00\xff"))
    assert [store.add("key3", n) for n in range(1, 7)] == [1, 3, 6, 10, 15, 21]
    assert store.num_keys() == before + 5
    assert store.get("key") == b"6" and store.get("key3") == b"21"
    assert store.get("key0") == b"value0" and store.get("key1") == b"value1" and store.get("key2") == b"\x00\xff"
    assert store.check(["key3"]) and store.check(["key0", "key1"])
    assert not store.check(["Randomkey3"]) and not store.check(["key0", "Randomkey3"])
    assert store.add("key3", 0) == 21 and store.add("negative", -3) == -3
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    assert store.delete_key("-key3") is True and store.delete_key("-key3") is False
    assert store.num_keys() == before + 6


def test_keys_are_scoped_by_the_prefix(make_base: Callable[[], dist.Store]) -> None:
    base = make_base()
    one, two = dist.PrefixStore("one", base), dist.PrefixStore("two", base)
    one.set("k", "1")
    assert not two.check(["k"]) and not base.check(["k"])
    assert dist.PrefixStore("one", make_base()).get("k") == b"1"


def test_compare_set(store: dist.Store) -> None:
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    assert not store.check(["cs_key0"])  # a missing key with a non-empty expected value stays missing
    store.set("cs_key0", "value0")
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"  # missing + empty expected: created
    assert store.get("cs_key1") == b"new_value1"
    store.set("empty", "")
    assert store.compare_set("empty", "", "filled") == b"filled"


def test_wait_reports_the_timeout_asked_for(store: dist.Store) -> None:
    with pytest.raises(dist.DistStoreError, match=_timeout_error(250, "bad_key")):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])
    store.wait(["good_key"], timedelta(seconds=0.25))
    store.wait([])


def test_set_timeout_on_the_wrapper_bounds_get_and_multi_get(store: dist.Store) -> None:
    store.set_timeout(timedelta(seconds=0.2))
    assert store.timeout == timedelta(seconds=0.2)
    with pytest.raises(dist.DistStoreError, match=_timeout_error(200, "the_key")):
        store.get("the_key")
    with pytest.raises(dist.DistStoreError, match=_timeout_error(200, "the_key")):
        store.multi_get(["the_key"])
    store.set("the_key", "x")  # a timeout does not break the store
    assert store.get("the_key") == b"x"


def test_delete_then_get_times_out_and_count_follows(store: dist.Store) -> None:
    before = store.num_keys()
    store.add("key", 1)
    store.set("key0", "value0")
    store.set("key1", "value1")
    assert store.num_keys() == before + 3
    assert store.delete_key("key")
    assert store.num_keys() == before + 2
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.get("key")
    assert store.delete_key("key0")
    store.set("key4", "value2")
    assert store.num_keys() == before + 2
    assert store.get("key1") == b"value1" and store.get("key4") == b"value2"


def test_extended_api(store: dist.Store) -> None:
    assert store.has_extended_api()
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")
    store.append("bar", b"tato")
    assert store.get("foo") == b"potato" and store.get("bar") == b"potato"
    store.multi_set(["m0", "m1"], ["po", b"tato"])
    assert store.get("m0") == b"po" and store.get("m1") == b"tato"
    assert store.multi_get(["m1", "m0", "foo"]) == [b"tato", b"po", b"potato"]


def test_concurrent_add_and_append_apply_each_call_once(store: dist.Store) -> None:
    def work(i: int) -> None:
        for _ in range(5):
            store.add("counter", 1)
            store.append("log", str(i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.get("counter") == b"15"
    assert sorted(store.get("log").decode()) == sorted("000001111122222")


def test_clone_shares_the_keys_and_survives_collection(store: dist.Store) -> None:
    clone = store.clone()
    gc.collect()
    assert isinstance(clone, dist.Store)
    store.set("foo", "bar")
    assert clone.get("foo") == b"bar"
    clone.set("back", "1")
    assert store.get("back") == b"1" and clone.num_keys() == store.num_keys()


def test_wait_returns_when_another_thread_sets_the_keys(store: dist.Store) -> None:
    waiting, errors = threading.Event(), []

    def waiter() -> None:
        waiting.set()
        try:
            store.wait(["late0", "late1"], timedelta(seconds=60))
        except Exception as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait(10)
    other = store.clone()
    other.set("late0", "a")
    other.set("late1", "b")
    t.join(60)
    assert not t.is_alive() and errors == []


def test_rdzv_info_store_of_a_real_handler_is_prefixed_etcd(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    """What a script gets from the ``elasticzero`` handler on etcd: a PrefixStore over EtcdStore, fully working."""
    run = uuid.uuid4().hex[:12]
    params = RendezvousParameters("elasticzero", etcd_server.endpoint(), run, 1, 1, local_addr="127.0.0.1")
    handler = create_rdzv_handler(params)
    try:
        (info,) = join_all([handler])
        store = info.store
        assert isinstance(store, dist.PrefixStore) and isinstance(store.underlying_store, EtcdStore)
        store.set("a", "1")
        assert store.num_keys() >= 1 and store.delete_key("a") and not store.check(["a"])
        assert store.has_extended_api() and isinstance(store.clone(), dist.Store)
        with pytest.raises(dist.DistStoreError, match=_timeout_error(100, "never")):
            store.wait(["never"], timedelta(seconds=0.1))
    finally:
        handler.shutdown()
