"""A per-agent etcd lease, kept alive by a daemon thread: the agent's member key and Store keys are attached to it.

The rendezvous state is *not* attached to any lease (see :mod:`.etcd_backend`): one agent leaving must not delete
it. If an agent dies its lease expires and its keys disappear; on a clean shutdown the agent revokes its lease.
A lease lost during an outage (longer than its TTL) is replaced by a new one; the callbacks registered with
:meth:`KeptLease.on_renew` then re-create what must outlive the loss (the agent's member key).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.rendezvous import RendezvousError

from elasticzero.rendezvous.etcd_client import EtcdAccessError, EtcdClient

logger = logging.getLogger(__name__)
T = TypeVar("T")


class KeptLease:
    """Grant a lease of ``ttl`` seconds and refresh it every ``ttl / 3`` seconds until :meth:`release`."""

    def __init__(self, client: EtcdClient, ttl: int, grant_timeout: float | None = None) -> None:
        self._client = client
        self._ttl = ttl
        self._lock = threading.Lock()
        self._id = client.grant(ttl, timeout=grant_timeout)
        self._renewed: list[Callable[[int], None]] = []
        self._unfinished: int | None = None  # a renewed lease whose callbacks have not all succeeded yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elasticzero-etcd-lease", daemon=True)
        self._thread.start()

    @property
    def id(self) -> int:
        """The current lease id."""
        with self._lock:
            return self._id

    def on_renew(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(new_lease_id)`` after every lease renewal (a lost lease replaced by a new one)."""
        self._renewed.append(callback)

    def renew(self, lost_id: int) -> int:
        """Grant a new lease if ``lost_id`` is still current (it expired, e.g. after a long outage); the new id.

        Keys that were attached to the lost lease are gone; the :meth:`on_renew` callbacks run with the new id.
        """
        with self._lock:
            if self._id != lost_id:
                return self._id
            self._id = new_id = self._client.grant(self._ttl)
            self._unfinished = new_id
            logger.warning("elasticzero: etcd lease %x was lost; granted %x", lost_id, new_id)
        self._run_callbacks(new_id)
        return new_id

    def _run_callbacks(self, lease_id: int) -> None:
        """Run every :meth:`on_renew` callback for ``lease_id``; on failure the keep-alive thread runs them again."""
        for callback in self._renewed:
            callback(lease_id)
        with self._lock:
            if self._unfinished == lease_id:
                self._unfinished = None

    def attached(self, op: Callable[[int], T]) -> T:
        """Run ``op(lease_id)``; if etcd says the lease is gone, renew it and run once more."""
        lease_id = self.id
        try:
            return op(lease_id)
        except EtcdAccessError as exc:
            if exc.code != "NOT_FOUND":
                raise
            return op(self.renew(lease_id))

    def _run(self) -> None:
        interval = max(0.5, self._ttl / 3)
        while not self._stop.wait(interval):
            lease_id = self.id
            try:
                if self._client.keep_alive_once(lease_id, timeout=interval) <= 0:
                    self.renew(lease_id)
                elif self._unfinished == lease_id:
                    self._run_callbacks(lease_id)  # a renewal whose callbacks failed (etcd flapping): again
            except RendezvousError as exc:
                if self._stop.is_set():
                    return
                logger.warning("elasticzero: etcd lease keep-alive failed (will retry): %s", exc)

    def release(self, timeout: float = 5.0) -> None:
        """Stop refreshing and revoke the lease (best effort): the keys attached to it are deleted."""
        self._stop.set()
        self._thread.join(timeout)
        try:
            self._client.revoke(self.id, timeout=timeout)
        except RendezvousError as exc:
            logger.warning("elasticzero: could not revoke the etcd lease (it expires in %ss): %s", self._ttl, exc)
