"""Small builders for the etcd semantics tests: a client, a lease, a store, a backend on a real cluster; joining."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.endpoint import parse_endpoint
from elasticzero.rendezvous.etcd_backend import EtcdRendezvousBackend
from elasticzero.rendezvous.etcd_client import EtcdClient, EtcdSettings
from elasticzero.rendezvous.etcd_lease import KeptLease
from elasticzero.rendezvous.etcd_store import EtcdStore


def client_for(cluster: EtcdCluster, retry_timeout: float = 10.0, **kw: object) -> EtcdClient:
    """A client on every member of ``cluster``."""
    spec = parse_endpoint(cluster.endpoint())
    return EtcdClient(EtcdSettings(hosts=spec.hosts, tls=spec.tls, retry_timeout=retry_timeout, **kw))  # type: ignore[arg-type]


@contextlib.contextmanager
def leased_client(cluster: EtcdCluster, ttl: int = 10) -> Iterator[tuple[EtcdClient, KeptLease]]:
    """A client on ``cluster`` and a kept-alive lease of ``ttl`` seconds; lease released, client closed on exit."""
    client = client_for(cluster)
    lease = KeptLease(client, ttl)
    try:
        yield client, lease
    finally:
        lease.release()
        client.close()


def store_for(client: EtcdClient, lease: KeptLease, run: str = "run", timeout: float = 5.0) -> EtcdStore:
    """A store under ``/elasticzero/<run>/store``."""
    return EtcdStore(client, lease, f"/elasticzero/{run}/store", timedelta(seconds=timeout))


def backend_for(client: EtcdClient, run: str = "run") -> EtcdRendezvousBackend:
    """A state backend on ``/elasticzero/<run>/state``."""
    return EtcdRendezvousBackend(client, f"/elasticzero/{run}/state")


def join_all(handlers: Sequence[RendezvousHandler], timeout: float = 60.0) -> list[RendezvousInfo]:
    """``next_rendezvous()`` on every handler at once (one thread each); their infos in handler order."""
    infos: dict[int, RendezvousInfo] = {}

    def join(i: int) -> None:
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert sorted(infos) == list(range(len(handlers)))
    return [infos[i] for i in range(len(handlers))]
