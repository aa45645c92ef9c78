"""etcd v3 over gRPC with endpoint failover, TLS and user/password auth.

The protobuf stubs come from the python-etcd3 API family, imported lazily: ``pyetcd`` (PyPI ``etcd-sdk-python``,
current protobuf) first, ``etcd3`` only if that is what imports. Channels, credentials, auth tokens and failover
are handled here with plain ``grpc`` so both modules behave the same.

:meth:`EtcdClient.call` runs one RPC against the current endpoint; on a connection-type failure it moves to the
next endpoint and retries until ``retry_timeout`` has passed, then raises :class:`EtcdConnectionError` (a torch
``RendezvousConnectionError``). Auth tokens lost by a restarted member are renewed transparently.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError

from elasticzero.errors import UsageError

logger = logging.getLogger(__name__)

T = TypeVar("T")
INSTALL_HINT = "pip install 'elasticzero[etcd]'"
_MODULES = ("pyetcd", "etcd3")
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class EtcdConnectionError(RendezvousConnectionError):
    """No etcd endpoint answered within the allowed time."""


class EtcdAccessError(RendezvousError):
    """etcd answered but refused us (bad credentials, no permission on the prefix, TLS mismatch).

    ``code`` is the gRPC status name (``PERMISSION_DENIED``, ``NOT_FOUND`` for a lost lease, ...).
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def load_etcd_module() -> ModuleType:
    """The python-etcd3-API module (``pyetcd`` first, ``etcd3`` fallback); :class:`UsageError` if none imports."""
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
            importlib.import_module(f"{name}.etcdrpc")
            return module
        except Exception as exc:  # etcd3 0.12 raises TypeError beside protobuf >= 4, not ImportError
            errors.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
    raise UsageError(
        f"the etcd rendezvous needs an etcd v3 client; run: {INSTALL_HINT} (import failed: {'; '.join(errors)})"
    )


@dataclass(frozen=True)
class EtcdSettings:
    """Where and how to connect: ``hosts`` in failover order; TLS files; user (password from the environment)."""

    hosts: tuple[tuple[str, int], ...]
    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    rpc_timeout: float = 5.0
    retry_timeout: float = 60.0

    def describe(self) -> str:
        """Endpoints as a URL list for messages (never the password)."""
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.hosts)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read etcd TLS file {path!r}: {exc.strerror}") from None


class _Endpoint:
    """A gRPC channel to one member plus its auth token."""

    def __init__(self, module: ModuleType, grpc: ModuleType, target: str, settings: EtcdSettings) -> None:
        self.target = target
        if settings.tls:
            creds = grpc.ssl_channel_credentials(_read(settings.cacert), _read(settings.key), _read(settings.cert))
            self.channel = grpc.secure_channel(target, creds, options=_GRPC_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(target, options=_GRPC_OPTIONS)
        rpc = module.etcdrpc
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self.auth = rpc.AuthStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] | None = None


class EtcdClient:
    """A small etcd v3 client: one current endpoint, failover on connection errors, retries until a deadline."""

    def __init__(self, settings: EtcdSettings) -> None:
        if not settings.hosts:
            raise UsageError("the etcd rendezvous needs at least one endpoint")
        self.settings = settings
        self.module = load_etcd_module()
        self.rpc: Any = self.module.etcdrpc
        import grpc

        self._grpc = grpc
        self._retryable = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
        self._endpoints = [_Endpoint(self.module, grpc, f"{h}:{p}", settings) for h, p in settings.hosts]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

    # -- connection management -------------------------------------------------------------------------------

    def _authenticate(self, ep: _Endpoint, timeout: float) -> None:
        if self.settings.user is None or ep.metadata is not None:
            return
        if self.settings.password is None:
            raise EtcdAccessError(f"etcd user {self.settings.user!r} given but no password in the environment")
        req = self.rpc.AuthenticateRequest(name=self.settings.user, password=self.settings.password)
        resp = ep.auth.Authenticate(req, timeout=timeout)
        ep.metadata = (("token", resp.token),)

    def _fail_over(self, ep: _Endpoint) -> None:
        with self._lock:
            if self._endpoints[self._current] is ep:
                self._current = (self._current + 1) % len(self._endpoints)

    def call(self, op: Callable[[_Endpoint, float], T], timeout: float | None = None, what: str = "request") -> T:
        """Run ``op(endpoint, rpc_timeout)``, failing over and retrying connection errors for up to ``timeout`` s."""
        budget = self.settings.retry_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        attempt = 0
        last: BaseException | None = None
        while True:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed")
            ep = self._endpoints[self._current]
            remaining = deadline - time.monotonic()
            rpc_timeout = max(0.05, min(self.settings.rpc_timeout, remaining))
            try:
                self._authenticate(ep, rpc_timeout)
                return op(ep, rpc_timeout)
            except self._grpc.RpcError as exc:
                code = exc.code()
                detail = exc.details() or ""
                if code == self._grpc.StatusCode.UNAUTHENTICATED and self.settings.user is not None:
                    ep.metadata = None  # token lost (member restarted): authenticate again
                elif code in self._retryable:
                    self._fail_over(ep)
                else:
                    raise EtcdAccessError(
                        f"etcd {ep.target} refused the {what}: {code.name}: {detail} "
                        f"(check user/role permissions on the prefix and the TLS files)",
                        code.name,
                    ) from exc
                last = exc
            attempt += 1
            if time.monotonic() >= deadline:
                reason = last.details() if isinstance(last, self._grpc.RpcError) else last
                raise EtcdConnectionError(
                    f"no etcd endpoint of {self.settings.describe()} answered the {what} within {budget:g}s "
                    f"(last error: {reason})"
                ) from last
            if attempt % len(self._endpoints) == 0:
                time.sleep(
                    min(1.0, 0.05 * 2 ** (attempt // len(self._endpoints)), max(0.0, deadline - time.monotonic()))
                )

    def close(self) -> None:
        """Close every channel; later calls raise :class:`EtcdConnectionError`."""
        self._closed = True
        for ep in self._endpoints:
            ep.channel.close()

    # -- primitives ------------------------------------------------------------------------------------------

    def range(self, key: bytes, range_end: bytes | None = None, count_only: bool = False, **kw: Any) -> Any:
        """A linearizable ``Range`` (one key, or ``[key, range_end)``)."""
        req = self.rpc.RangeRequest(key=key, count_only=count_only)
        if range_end is not None:
            req.range_end = range_end
        return self.call(lambda ep, t: ep.kv.Range(req, timeout=t, metadata=ep.metadata), what="read", **kw)

    def txn(self, compare: list[Any], success: list[Any], failure: list[Any], **kw: Any) -> Any:
        """A ``Txn``: ``success`` ops if every ``compare`` holds, else ``failure`` ops (atomically)."""
        req = self.rpc.TxnRequest(compare=compare, success=success, failure=failure)
        return self.call(lambda ep, t: ep.kv.Txn(req, timeout=t, metadata=ep.metadata), what="transaction", **kw)

    def delete_range(self, key: bytes, range_end: bytes, **kw: Any) -> int:
        """Delete ``[key, range_end)``; the number of keys deleted."""
        req = self.rpc.DeleteRangeRequest(key=key, range_end=range_end)
        resp = self.call(lambda ep, t: ep.kv.DeleteRange(req, timeout=t, metadata=ep.metadata), what="delete", **kw)
        return int(resp.deleted)

    def grant(self, ttl: int, **kw: Any) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        req = self.rpc.LeaseGrantRequest(TTL=ttl)
        resp = self.call(lambda ep, t: ep.lease.LeaseGrant(req, timeout=t, metadata=ep.metadata), what="lease", **kw)
        return int(resp.ID)

    def keep_alive_once(self, lease_id: int, **kw: Any) -> int:
        """Refresh a lease once; its remaining TTL (``<= 0``: the lease is gone)."""

        def op(ep: _Endpoint, t: float) -> int:
            stream = ep.lease.LeaseKeepAlive(
                iter([self.rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=t, metadata=ep.metadata
            )
            for resp in stream:
                return int(resp.TTL)
            return 0

        return self.call(op, what="lease keep-alive", **kw)

    def revoke(self, lease_id: int, **kw: Any) -> None:
        """Revoke a lease: every key attached to it is deleted."""
        req = self.rpc.LeaseRevokeRequest(ID=lease_id)
        self.call(lambda ep, t: ep.lease.LeaseRevoke(req, timeout=t, metadata=ep.metadata), what="lease revoke", **kw)

    def watch_until(self, keys: list[bytes], ready: Callable[[], bool], timeout: float) -> bool:
        """Block until ``ready()`` is true (True) or ``timeout`` passes (False), re-checking on each put to ``keys``.

        One watch covers every key (the range from the smallest to the largest). It starts at the current revision,
        so etcd serves it as a synced watcher (no catch-up delay), and ``ready()`` is checked once the watch exists:
        a put before that is seen by the check, a put after it wakes the watch. That is TCPStore's semantics (a key
        set and deleted before the wait started is not seen). Connection errors are retried like any other call.
        """
        deadline = time.monotonic() + timeout
        create = self.rpc.WatchCreateRequest(
            key=min(keys), range_end=max(keys) + b"\0", filters=[self.rpc.WatchCreateRequest.NODELETE]
        )

        def op(ep: _Endpoint, _rpc_timeout: float) -> bool:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ready()
            done = threading.Event()

            def requests() -> Iterator[Any]:
                yield self.rpc.WatchRequest(create_request=create)
                done.wait()

            stream = ep.watch.Watch(requests(), timeout=remaining, metadata=ep.metadata)
            try:
                for resp in stream:
                    if (resp.created or resp.events) and ready():
                        return True
                return ready()
            except self._grpc.RpcError:
                # etcd 3.4 ends a timed-out watch with DEADLINE_EXCEEDED, 3.5 with UNKNOWN "context deadline exceeded"
                if time.monotonic() >= deadline - 0.1:
                    return False
                raise
            finally:
                done.set()
                stream.cancel()

        return self.call(op, timeout=max(timeout, self.settings.retry_timeout), what="watch")
