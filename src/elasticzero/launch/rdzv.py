"""The rendezvous every agent is told to use, decided and checked once, before anything starts (pure).

Two ways to name it, never both:

* ``--master-addr`` / ``--master-port`` (DeepSpeed's): a c10d store on that host (default: the first host, port
  29500), hosted by node 0's agent;
* ``--rdzv-endpoint`` (torchrun's): ``HOST[:PORT]`` / ``tcp://HOST:PORT`` the same c10d store, or
  ``etcd://H:P[,H:P…]`` / ``etcds://…`` / ``https://…`` an etcd v3 cluster (``--rdzv-backend elasticzero``, the
  default, is the one that speaks etcd v3) — a store that outlives any node of the job.

The endpoint and ``--rdzv-conf`` are checked by the rendezvous's own pure parsers
(:mod:`elasticzero.rendezvous.endpoint`, :mod:`elasticzero.rendezvous.options`): a bad key or value is one line
here instead of one per node later. The etcd password is never a flag: with ``user=`` every agent reads it from
``$ELASTICZERO_ETCD_PASSWORD`` (or the variable ``password_env=`` names), which the launcher exports by name, so
it travels as the other exported values do (never in an argv; masked in ``--dry-run``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticzero.errors import UsageError
from elasticzero.launch.hostfile import host_problem, is_loopback, normalize_host
from elasticzero.launch.plan import is_secret
from elasticzero.rendezvous.endpoint import EndpointSpec, parse_endpoint
from elasticzero.rendezvous.options import misplaced_keys, parse_options

#: the backend every agent gets unless ``--rdzv-backend`` says otherwise; the one that speaks etcd v3
DEFAULT_BACKEND = "elasticzero"
DEFAULT_MASTER_PORT = 29500
#: the rendezvous host of a plan whose one node is this machine
LOCAL_MASTER = "127.0.0.1"
#: backends that only ever start this machine's node
SINGLE_NODE_BACKENDS = frozenset({"local"})


@dataclass(frozen=True)
class RendezvousTarget:
    """What every agent's ``--rdzv-*`` flags say.

    ``master_addr``/``master_port``: the c10d store's host and port (with etcd: the first host and the default
    port, which only a per-rank launch, having no rendezvous, would use). ``endpoint``: the etcd URL, or ``None``
    for the c10d store at ``master_addr:master_port``. ``password_env``: the variable every agent needs (etcd
    ``user=``), or ``None``.
    """

    backend: str
    master_addr: str
    master_port: int
    conf: tuple[tuple[str, str], ...] = ()
    endpoint: str | None = None
    password_env: str | None = None


@dataclass(frozen=True)
class RendezvousFlags:
    """The command line's rendezvous flags, as given (``None``: not given)."""

    backend: str | None = None
    endpoint: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    conf: str | None = None


@dataclass(frozen=True)
class JobShape:
    """What the checks need of the plan: its first host, node count, ``--nnodes`` and launcher backend."""

    first_host: str
    n_nodes: int
    nnodes: str
    launcher: str


def rendezvous_target(flags: RendezvousFlags, shape: JobShape) -> RendezvousTarget:
    """The checked rendezvous of a plan; one :class:`UsageError` line for anything wrong."""
    backend = flags.backend or DEFAULT_BACKEND
    conf = parse_conf(flags.conf)
    if flags.endpoint is None:
        explicit = master_addr(flags.master_addr)
        host = explicit or (LOCAL_MASTER if shape.first_host == "localhost" else shape.first_host)
        check_reachable([explicit or shape.first_host], explicit is not None, shape)
        _check_conf(backend, "c10d", conf)
        return RendezvousTarget(backend, host, flags.master_port or DEFAULT_MASTER_PORT, conf)
    return _from_endpoint(flags, shape, backend, conf)


def _from_endpoint(
    flags: RendezvousFlags, shape: JobShape, backend: str, conf: tuple[tuple[str, str], ...]
) -> RendezvousTarget:
    """``--rdzv-endpoint``: alone (not with ``--master-addr``/``--master-port``), a c10d host or etcd URLs."""
    given = [f for f, v in (("--master-addr", flags.master_addr), ("--master-port", flags.master_port)) if v]
    if given:
        raise UsageError(
            f"--rdzv-endpoint and {given[0]} both name the rendezvous; give it once (--rdzv-endpoint HOST:PORT "
            "or etcd://H:P, or --master-addr/--master-port)"
        )
    spec = _endpoint(flags.endpoint or "", backend)
    hosts = [_endpoint_host(h, flags.endpoint or "") for h, _ in spec.hosts]
    check_reachable(hosts, True, shape, flag="--rdzv-endpoint")
    _check_conf(backend, spec.kind, conf)
    if spec.kind == "c10d":
        return RendezvousTarget(backend, hosts[0], spec.hosts[0][1], conf)
    first = LOCAL_MASTER if shape.first_host == "localhost" else shape.first_host
    url = (flags.endpoint or "").strip()
    return RendezvousTarget(backend, first, DEFAULT_MASTER_PORT, conf, url, _password_env(conf))


def _endpoint(text: str, backend: str) -> EndpointSpec:
    spec = parse_endpoint(text)
    if spec.kind == "etcd" and backend != DEFAULT_BACKEND:
        raise UsageError(
            f"--rdzv-endpoint {text}: only --rdzv-backend {DEFAULT_BACKEND} speaks etcd v3 "
            f"(got --rdzv-backend {backend}); drop --rdzv-backend"
        )
    return spec


def _endpoint_host(host: str, text: str) -> str:
    bare = normalize_host(host)
    if bare is None:
        raise UsageError(f"--rdzv-endpoint {text}: {host_problem(host)}")
    return bare


def master_addr(addr: str | None) -> str | None:
    """``--master-addr`` in canonical form; a URL (``etcd://…``) is one line naming ``--rdzv-endpoint``."""
    if addr is None:
        return None
    if "://" in addr:
        raise UsageError(
            f"--master-addr takes a host name or address, not the URL {addr!r}; "
            f"name a rendezvous endpoint with --rdzv-endpoint {addr}"
        )
    host = normalize_host(addr)
    if host is None:
        raise UsageError(f"--master-addr: {host_problem(addr)}")
    return host


def parse_conf(text: str | None) -> tuple[tuple[str, str], ...]:
    """``--rdzv-conf K=V,…`` as pairs, in order; a malformed item is a :class:`UsageError`."""
    if not text:
        return ()
    pairs = []
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--rdzv-conf {text!r}: bad item {item!r}; expected KEY=VALUE[,KEY=VALUE…]")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _check_conf(backend: str, kind: str, conf: Sequence[tuple[str, str]]) -> None:
    """The elasticzero rendezvous's keys, checked by its own parser, and each read by this store kind."""
    if backend != DEFAULT_BACKEND:
        return  # another backend's keys are that backend's business (torch's c10d, static, …)
    mapping = dict(conf)
    parse_options(mapping)
    wrong = misplaced_keys(kind, mapping)
    if wrong:
        other = "an etcd endpoint (--rdzv-endpoint etcd://H:P)" if kind == "c10d" else "a c10d store"
        raise UsageError(f"--rdzv-conf {wrong[0]}= applies to {other} only; drop it or change the endpoint")


def _password_env(conf: Sequence[tuple[str, str]]) -> str | None:
    """The variable holding the etcd password when ``user=`` is set; it must look secret (it is masked by name)."""
    mapping = dict(conf)
    if "user" not in mapping:
        return None
    name = parse_options(mapping).etcd.password_env
    if not is_secret(name):
        raise UsageError(
            f"--rdzv-conf password_env={name}: the launcher hides values by their name and {name} does not look "
            "secret; name a variable containing PASSWORD (e.g. the default ELASTICZERO_ETCD_PASSWORD)"
        )
    return name


def check_reachable(hosts: Sequence[str], explicit: bool, shape: JobShape, flag: str = "--master-addr") -> None:
    """A rendezvous on a loopback address with more than one node is a split brain: refuse it.

    More than one node means: several nodes in the plan, or an elastic ``--nnodes MIN:MAX`` with MAX > 1 on a
    backend that can start other machines. Only the literal text is checked (no DNS).
    """
    max_nodes = int(shape.nnodes.rpartition(":")[2])
    elastic = max_nodes > 1 and shape.launcher not in SINGLE_NODE_BACKENDS
    loop = [h for h in hosts if is_loopback(h)]
    if not loop or (shape.n_nodes <= 1 and not elastic):
        return
    what = f"{shape.n_nodes} nodes" if shape.n_nodes > 1 else f"up to {max_nodes} nodes (--nnodes {shape.nnodes})"
    where = f"{flag} {loop[0]}" if explicit else f"the first host {loop[0]!r}"
    raise UsageError(
        f"rendezvous on {where} is a loopback address but the job spans {what}: every node would host its own "
        f"rendezvous (split brain); {_REACHABLE_FIX[flag if explicit else '']}"
    )


#: how to fix a loopback rendezvous, by the flag that named it ("": the default, the first host)
_REACHABLE_FIX = {
    "--master-addr": "pass --master-addr with the first host's routable name or address",
    "--rdzv-endpoint": "pass --rdzv-endpoint with names or addresses every node can reach",
    "": "list the first host by a name or address the other nodes can reach, or pass --master-addr ADDR",
}


def exported_password(
    target: RendezvousTarget, exported: Mapping[str, str], environ: Mapping[str, str]
) -> dict[str, str]:
    """The exported environment plus the etcd password's variable (by name, as every exported value travels)."""
    name = target.password_env
    if name is None or name in exported:
        return dict(exported)
    if name not in environ:
        raise UsageError(
            f"--rdzv-conf user=: every agent reads the etcd password from ${name}, which is not set here; "
            f"export {name}=… in this shell or an env file (never on the command line)"
        )
    return {**exported, name: environ[name]}
