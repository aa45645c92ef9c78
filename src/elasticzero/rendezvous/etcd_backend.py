"""The etcd v3 backend of the ``elasticzero`` rendezvous: torch's pickled state under one key, CAS by transaction.

Key layout (``prefix`` defaults to ``/elasticzero``)::

    <prefix>/<run_id>/state        torch's pickled _RendezvousState (token = the key's mod_revision)
    <prefix>/<run_id>/store/<key>  the agents' Store keys (EtcdStore)

Every key is attached to the writing agent's lease (see :mod:`.etcd_lease`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elasticzero.errors import UsageError
from elasticzero.rendezvous.c10d import BACKEND_NAME
from elasticzero.rendezvous.endpoint import EndpointSpec
from elasticzero.rendezvous.etcd_client import EtcdClient, EtcdConnectionError, EtcdSettings
from elasticzero.rendezvous.etcd_lease import KeptLease
from elasticzero.rendezvous.etcd_ops import Ops, range_kvs
from elasticzero.rendezvous.etcd_store import EtcdStore
from elasticzero.rendezvous.options import RendezvousOptions


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd key; ``set_state`` is a single compare-and-swap transaction."""

    def __init__(self, client: EtcdClient, lease: KeptLease, state_key: str) -> None:
        self._client = client
        self._lease = lease
        self._ops = Ops(client.rpc)
        self._key = state_key.encode()

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class: the state and its token (the key's ``mod_revision``), or ``None``."""
        kvs = list(self._client.range(self._key).kvs)
        if not kvs:
            return None
        return bytes(kvs[0].value), int(kvs[0].mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class: create-if-absent (``version == 0``) without a token, else CAS on ``mod_revision``."""
        if token is not None and not isinstance(token, int):
            current = self.get_state()
            return None if current is None else (*current, False)
        guard = self._ops.absent(self._key) if token is None else self._ops.mod_is(self._key, token)
        resp = self._lease.attached(
            lambda lease: self._client.txn(
                [guard], [self._ops.put(self._key, state, lease), self._ops.get(self._key)], [self._ops.get(self._key)]
            )
        )
        kvs = range_kvs(resp, 1 if resp.succeeded else 0)
        if not kvs:
            return None
        return bytes(kvs[0].value), int(kvs[0].mod_revision), bool(resp.succeeded)


@dataclass
class EtcdRendezvous:
    """What the handler needs from the etcd side: the backend, the Store, and the release hook for shutdown."""

    backend: EtcdRendezvousBackend
    store: EtcdStore
    release: Callable[[], None]


def etcd_settings(spec: EndpointSpec, options: RendezvousOptions) -> EtcdSettings:
    """Connection settings from the endpoint and ``--rdzv-conf``; the password comes from the environment only."""
    o = options.etcd
    password = None
    if o.user is not None:
        password = os.environ.get(o.password_env)
        if password is None:
            raise UsageError(f"--rdzv-conf user={o.user} needs the etcd password in ${o.password_env}")
    return EtcdSettings(
        hosts=spec.hosts,
        tls=spec.tls or o.cacert is not None,
        cacert=o.cacert,
        cert=o.cert,
        key=o.key,
        user=o.user,
        password=password,
        retry_timeout=o.retry_timeout,
    )


def create_etcd_backend(params: RendezvousParameters, spec: EndpointSpec, options: RendezvousOptions) -> EtcdRendezvous:
    """Connect (bounded by ``connect_timeout``), grant this agent's lease, and build the backend and Store."""
    settings = etcd_settings(spec, options)
    client = EtcdClient(settings)
    run_root = f"{options.etcd.prefix}/{params.run_id}"
    try:
        client.range(f"{run_root}/state".encode(), timeout=options.etcd.connect_timeout)
        lease = KeptLease(client, options.etcd.lease_ttl, grant_timeout=options.etcd.connect_timeout)
    except EtcdConnectionError as exc:
        client.close()
        raise EtcdConnectionError(
            f"elasticzero rendezvous: cannot reach etcd at {settings.describe()} "
            f"within connect_timeout={options.etcd.connect_timeout:g}s; is etcd running and the endpoint right? ({exc})"
        ) from exc
    except BaseException:
        client.close()
        raise
    backend = EtcdRendezvousBackend(client, lease, f"{run_root}/state")
    store = EtcdStore(client, lease, f"{run_root}/store", timedelta(seconds=options.read_timeout))

    def release() -> None:
        lease.release()
        client.close()

    return EtcdRendezvous(backend, store, release)
