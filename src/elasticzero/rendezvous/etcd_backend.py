"""The etcd v3 backend of the ``elasticzero`` rendezvous: torch's pickled state under one key, CAS by transaction.

Key layout (``prefix`` defaults to ``/elasticzero``)::

    <prefix>/<run_id>/state            torch's pickled _RendezvousState (token = the key's mod_revision); no lease
    <prefix>/<run_id>/members/<lease>  one key per live agent, attached to that agent's lease
    <prefix>/<run_id>/store/<key>      the agents' Store keys (EtcdStore); no lease (they outlive their writer)
    <prefix>/<run_id>/ops/<uuid>       short-lived markers that make ``EtcdStore.add`` idempotent, on the writer's lease

The state and the Store keys are written without a lease, so an agent that closes the rendezvous, or sets a barrier's
done flag, and leaves does not take the flag with it. The run's keys are deleted by the last agent to leave
(:class:`RunMembership`); a run whose agents all died (no member key left) is wiped by the next agent that joins it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elasticzero.errors import UsageError
from elasticzero.rendezvous.c10d import BACKEND_NAME
from elasticzero.rendezvous.endpoint import EndpointSpec
from elasticzero.rendezvous.etcd_client import EtcdClient, EtcdConnectionError, EtcdSettings
from elasticzero.rendezvous.etcd_lease import KeptLease
from elasticzero.rendezvous.etcd_ops import Ops, prefix_end, range_kvs
from elasticzero.rendezvous.etcd_store import EtcdStore
from elasticzero.rendezvous.options import RendezvousOptions

logger = logging.getLogger(__name__)


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd key; ``set_state`` is a single compare-and-swap transaction.

    The key has no lease: its lifetime is the run's (see :class:`RunMembership`), not one agent's.
    """

    def __init__(self, client: EtcdClient, state_key: str) -> None:
        self._client = client
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
        resp = self._client.txn(
            [guard], [self._ops.put(self._key, state), self._ops.get(self._key)], [self._ops.get(self._key)]
        )
        kvs = range_kvs(resp, 1 if resp.succeeded else 0)
        if not kvs:
            return None
        return bytes(kvs[0].value), int(kvs[0].mod_revision), bool(resp.succeeded)


class RunMembership:
    """This agent's member key ``<run>/members/<lease id>``; the last agent to leave deletes the run's keys.

    :meth:`join` first wipes a run that has no member left (its agents all died without cleaning up, so its state,
    possibly closed, is stale), then registers. :meth:`leave` deletes the whole ``<run>/`` prefix in one
    transaction if no other member key exists, else only its own key. Both decisions are single etcd transactions
    (a range compare ``version == 0`` holds exactly when the range is empty), so two agents cannot both miss each
    other. The member key follows the lease: after a lost lease it is registered again on the new one.
    """

    def __init__(self, client: EtcdClient, lease: KeptLease, run_root: str) -> None:
        self._client = client
        self._lease = lease
        self._ops = Ops(client.rpc)
        self._run = run_root.rstrip("/").encode() + b"/"
        self._members = self._run + b"members/"
        self._value = f"{socket.gethostname()}:{os.getpid()}".encode()
        self._key = self._member_key(lease.id)
        lease.on_renew(self._register)

    def _member_key(self, lease_id: int) -> bytes:
        return self._members + f"{lease_id:x}".encode()

    @property
    def key(self) -> bytes:
        """This agent's current member key."""
        return self._key

    def _register(self, lease_id: int) -> None:
        old, self._key = self._key, self._member_key(lease_id)
        ops = [self._ops.put(self._key, self._value, lease_id)]
        if old != self._key:
            ops.append(self._ops.delete(old))
        self._client.txn([], ops, [])

    def join(self) -> bool:
        """Wipe the run if it has no live member (whether it did: True), then register this agent."""
        resp = self._client.txn(
            [self._ops.none_in(self._members, prefix_end(self._members))],
            [self._ops.delete(self._run, prefix_end(self._run))],
            [],
        )
        wiped = bool(resp.succeeded) and int(resp.responses[0].response_delete_range.deleted) > 0
        if wiped:
            logger.warning("elasticzero: run %s had no live agent; removed its stale keys", self._run.decode())
        self._lease.attached(self._register)
        return wiped

    def leave(self) -> bool:
        """Remove this agent; if it was the last one, delete every key of the run (True)."""
        key = self._key
        resp = self._client.txn(
            [
                self._ops.none_in(self._members, key),
                self._ops.none_in(key + b"\0", prefix_end(self._members)),
            ],
            [self._ops.delete(self._run, prefix_end(self._run))],
            [self._ops.delete(key)],
        )
        return bool(resp.succeeded)


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
    membership = RunMembership(client, lease, run_root)
    try:
        membership.join()
    except BaseException:
        lease.release()
        client.close()
        raise
    backend = EtcdRendezvousBackend(client, f"{run_root}/state")
    store = EtcdStore(client, lease, f"{run_root}/store", timedelta(seconds=options.read_timeout))

    def release() -> None:
        try:
            if membership.leave():
                logger.info("elasticzero: last agent of %s left; removed the run's keys", run_root)
        except RendezvousError as exc:
            logger.warning("elasticzero: could not leave the etcd run %s (its member key expires): %s", run_root, exc)
        lease.release()
        client.close()

    return EtcdRendezvous(backend, store, release)
