"""A :class:`torch.distributed.Store` on etcd v3, for the agents' bookkeeping around a rendezvous.

Keys live under ``<prefix>/<run_id>/store/`` with no lease: like TCPStore's, a key stays until it is deleted, whoever
wrote it and whether that agent is still there (torch's exit barrier depends on it: the last agent to arrive sets the
done flag and shuts down at once). The run's keys are removed with the run (see :mod:`.etcd_backend`). ``wait`` opens
one watch over the missing keys and re-reads them when one is put (it does not poll), with TCPStore's semantics.
Timeouts raise :class:`torch.distributed.DistStoreError`, like torch's TCPStore.

torch reaches this class from C++ whenever it is wrapped (``PrefixStore``, which is what ``rdzv_info.store`` is):
the pybind11 trampoline (``PythonStore`` in torch/csrc/distributed/c10d/init.cpp) looks up ``getNumKeys``,
``deleteKey``, ``clone``, ``has_extended_api``, ``multi_get``, ``multi_set`` and ``append`` by those names, and
``set_timeout`` on a wrapper changes the C++ timeout only, so the default timeout is always read from ``self.timeout``.
The conformance test (tests/integration/rendezvous/test_store_conformance.py) runs the same contract on this store
and on TCPStore, both through ``PrefixStore``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store
from torch.distributed.elastic.rendezvous import RendezvousError

from elasticzero.rendezvous.etcd_client import EtcdClient
from elasticzero.rendezvous.etcd_lease import KeptLease
from elasticzero.rendezvous.etcd_ops import Ops, prefix_end, range_kvs


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(Store):
    """torch's Store contract: set/get/add/compare_set/wait/check/delete_key/num_keys/clone + the extended API."""

    def __init__(self, client: EtcdClient, lease: KeptLease, key_prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._client = client
        self._lease = lease
        self._ops = Ops(client.rpc)
        self._prefix = key_prefix.rstrip("/").encode() + b"/"
        # markers of add() calls live beside the store (``<run>/ops/``), so num_keys() does not count them
        self._ops_prefix = key_prefix.rstrip("/").rsplit("/", 1)[0].encode() + b"/ops/"

    def has_extended_api(self) -> bool:
        """``append``, ``multi_get`` and ``multi_set`` are native (one etcd transaction each)."""
        return True

    def clone(self) -> EtcdStore:
        """This same store: it is thread-safe (one gRPC channel, the lease kept by its own thread), which is what
        ``clone()`` is for. A new Python object would not do: torch's C++ side keeps only the C++ half alive."""
        return self

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _limit(self, timeout: timedelta | None) -> timedelta:
        """The timeout a blocking call honours: the one asked for, else the store's (C++ side, see module doc)."""
        return self.timeout if timeout is None else timeout  # type: ignore[attr-defined]  # pybind property, no stub

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``key``."""
        self._client.txn([], [self._ops.put(self._key(key), _bytes(value))], [])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Write several keys in one transaction."""
        puts = [self._ops.put(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._client.txn([], puts, [])

    def _read(self, keys: list[bytes]) -> tuple[list[bytes | None], int]:
        resp = self._client.txn([], [self._ops.get(k) for k in keys], [])
        values = []
        for i in range(len(keys)):
            kvs = range_kvs(resp, i)
            values.append(bytes(kvs[0].value) if kvs else None)
        return values, int(resp.header.revision)

    def _wait_missing(self, keys: list[bytes], timeout: timedelta) -> list[bytes]:
        """Block until every key exists (one watch over the missing ones), at most ``timeout``; their values."""
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + (seconds if seconds > 0 else 365 * 24 * 3600.0)
        found: list[bytes] = []
        missing: list[bytes] = []

        def ready() -> bool:
            values, _ = self._read(keys)
            missing[:] = [k for k, v in zip(keys, values, strict=True) if v is None]
            found[:] = [v for v in values if v is not None]
            return not missing

        if ready():
            return found
        if not self._client.watch_until(list(missing), ready, max(0.0, deadline - time.monotonic())):
            names = ", ".join(k[len(self._prefix) :].decode(errors="replace") for k in missing)
            ms = int(seconds * 1000)
            raise DistStoreError(f"etcd store wait timeout after {ms}ms, keys: {names}")
        return found

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting (up to the store timeout) until it exists."""
        return self._wait_missing([self._key(key)], self._limit(None))[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Several values read in one transaction, waiting for the missing ones."""
        return self._wait_missing([self._key(k) for k in keys], self._limit(None))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, or raise :class:`DistStoreError` after ``timeout`` (default: store's)."""
        self._wait_missing([self._key(k) for k in keys], self._limit(timeout))

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (no waiting)."""
        values, _ = self._read([self._key(k) for k in keys])
        return all(v is not None for v in values)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing = 0); the new value. Applied exactly once."""
        return int(self._update(key, lambda old: str((int(old) if old is not None else 0) + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        """Atomically append ``value`` to the bytes at ``key`` (missing = empty). Applied exactly once."""
        suffix = _bytes(value)
        self._update(key, lambda old: (old or b"") + suffix)

    def _update(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """Replace the value at ``key`` by ``change(old)`` (compare-and-swap on mod_revision); the value written.

        Each call writes a unique marker key (holding the new value) in the same transaction as the key. The client
        retries a transaction whose answer was lost (``DEADLINE_EXCEEDED``, fail-over); if that first attempt did
        commit, the retry's compare fails and the marker, read in the same transaction, says so: the call returns
        the committed value instead of applying ``change`` a second time. The marker is deleted afterwards.
        """
        k = self._key(key)
        marker = self._ops_prefix + uuid.uuid4().hex.encode()
        kvs = list(self._client.range(k).kvs)
        try:
            while True:
                current, revision = (bytes(kvs[0].value), int(kvs[0].mod_revision)) if kvs else (None, None)
                new = change(current)
                guard = self._ops.absent(k) if revision is None else self._ops.mod_is(k, revision)

                def attempt(lease: int, g: Any = guard, v: bytes = new) -> Any:
                    puts = [self._ops.put(k, v), self._ops.put(marker, v, lease)]
                    return self._client.txn([g], puts, [self._ops.get(k), self._ops.get(marker)])

                resp = self._lease.attached(attempt)
                if resp.succeeded:
                    return new
                done = range_kvs(resp, 1)
                if done:  # an earlier attempt of this call committed; its answer was lost
                    return bytes(done[0].value)
                kvs = range_kvs(resp, 0)
        finally:
            try:
                self._client.delete_range(marker, marker + b"\0")
            except RendezvousError:  # best effort: the marker is on this agent's lease and goes with it
                pass

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """TCPStore semantics: set ``desired`` if the value equals ``expected`` (or the key is missing and
        ``expected`` is empty); return the value now stored (or ``expected`` if the key is missing)."""
        k, expected, desired = self._key(key), _bytes(expected_value), _bytes(desired_value)
        guards = [self._ops.value_is(k, expected)]
        if not expected:
            guards = [self._ops.absent(k)]
        resp = self._client.txn(guards, [self._ops.put(k, desired)], [self._ops.get(k)])
        if resp.succeeded:
            return desired
        kvs = range_kvs(resp, 0)
        if not kvs:
            return expected
        if not expected and bytes(kvs[0].value) == b"":
            return self._swap_empty(k, desired)
        return bytes(kvs[0].value)

    def _swap_empty(self, k: bytes, desired: bytes) -> bytes:
        resp = self._client.txn([self._ops.value_is(k, b"")], [self._ops.put(k, desired)], [self._ops.get(k)])
        if resp.succeeded:
            return desired
        kvs = range_kvs(resp, 0)
        return bytes(kvs[0].value) if kvs else b""

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        k = self._key(key)
        return self._client.delete_range(k, k + b"\0") > 0

    def num_keys(self) -> int:
        """How many keys this store holds."""
        return int(self._client.range(self._prefix, prefix_end(self._prefix), count_only=True).count)

    # the names torch's C++ trampoline calls (a wrapper's num_keys()/delete_key() reach these, not the ones above)
    getNumKeys = num_keys
    deleteKey = delete_key
