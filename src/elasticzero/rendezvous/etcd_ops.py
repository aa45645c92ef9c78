"""Builders for etcd v3 transaction parts (compares and request ops) over the lazily imported protobuf module."""

from __future__ import annotations

from typing import Any


class Ops:
    """Shorthands for ``Compare`` and ``RequestOp`` messages of one ``etcdrpc`` module."""

    def __init__(self, rpc: Any) -> None:
        self.rpc = rpc

    def absent(self, key: bytes) -> Any:
        """``version(key) == 0``: the key does not exist (create-if-absent)."""
        c = self.rpc.Compare
        return c(key=key, target=c.VERSION, result=c.EQUAL, version=0)

    def mod_is(self, key: bytes, revision: int) -> Any:
        """``mod_revision(key) == revision``: nobody wrote the key since we read it (compare-and-swap)."""
        c = self.rpc.Compare
        return c(key=key, target=c.MOD, result=c.EQUAL, mod_revision=revision)

    def value_is(self, key: bytes, value: bytes) -> Any:
        """``value(key) == value`` (false for a missing key)."""
        c = self.rpc.Compare
        return c(key=key, target=c.VALUE, result=c.EQUAL, value=value)

    def none_in(self, key: bytes, range_end: bytes) -> Any:
        """No key exists in ``[key, range_end)`` (etcd compares every key of the range; an empty range holds)."""
        c = self.rpc.Compare
        return c(key=key, range_end=range_end, target=c.VERSION, result=c.EQUAL, version=0)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Any:
        """Put ``value`` attached to ``lease`` (0: no lease, the key stays until deleted)."""
        return self.rpc.RequestOp(request_put=self.rpc.PutRequest(key=key, value=value, lease=lease))

    def delete(self, key: bytes, range_end: bytes | None = None) -> Any:
        """Delete ``key`` (or ``[key, range_end)``)."""
        req = self.rpc.DeleteRangeRequest(key=key)
        if range_end is not None:
            req.range_end = range_end
        return self.rpc.RequestOp(request_delete_range=req)

    def get(self, key: bytes) -> Any:
        """Read one key (in the transaction's revision)."""
        return self.rpc.RequestOp(request_range=self.rpc.RangeRequest(key=key))


def range_kvs(txn_response: Any, index: int) -> list[Any]:
    """The key-values of the ``index``-th (range) response of a transaction."""
    return list(txn_response.responses[index].response_range.kvs)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"
