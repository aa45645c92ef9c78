"""Parse the ``--rdzv-endpoint`` of the ``elasticzero`` rendezvous into a store choice (pure, no I/O).

``HOST:PORT`` or ``tcp://HOST:PORT`` selects the c10d TCPStore; ``etcd://H1:P1,H2:P2`` selects etcd v3 over plain
gRPC; ``etcds://`` or ``https://`` selects etcd v3 over TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elasticzero.errors import UsageError

DEFAULT_C10D_PORT = 29400
DEFAULT_ETCD_PORT = 2379

_ETCD_SCHEMES = {"etcd": False, "http": False, "etcds": True, "https": True}


@dataclass(frozen=True)
class EndpointSpec:
    """Which store an endpoint names: ``kind`` is ``"c10d"`` or ``"etcd"``; ``hosts`` are ``(host, port)`` pairs."""

    kind: Literal["c10d", "etcd"]
    hosts: tuple[tuple[str, int], ...]
    tls: bool = False

    @property
    def c10d_endpoint(self) -> str:
        """The ``HOST:PORT`` form torch's c10d helpers expect (c10d endpoints only)."""
        host, port = self.hosts[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(item: str, default_port: int, endpoint: str) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise UsageError(f"rendezvous endpoint {endpoint!r} has an empty host entry")
    if item.startswith("["):  # [v6]:port
        host, _, rest = item[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif item.count(":") == 1:
        host, port_s = item.split(":")
    else:
        host, port_s = item, ""
    if not host:
        raise UsageError(f"rendezvous endpoint {endpoint!r} has an entry without a host: {item!r}")
    if not port_s:
        return host, default_port
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise UsageError(f"rendezvous endpoint {endpoint!r}: port {port_s!r} is not a number in 1..65535")
    return host, int(port_s)


def parse_endpoint(endpoint: str) -> EndpointSpec:
    """Parse an ``elasticzero`` rendezvous endpoint; raise :class:`UsageError` on a malformed one."""
    text = (endpoint or "").strip()
    if not text:
        raise UsageError(
            "the elasticzero rendezvous needs --rdzv-endpoint (HOST:PORT, tcp://HOST:PORT or etcd://H:P,..)"
        )
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    scheme = scheme.lower()
    rest = rest.rstrip("/")
    if scheme == "tcp":
        if "," in rest:
            raise UsageError(f"rendezvous endpoint {endpoint!r}: a c10d store has one HOST:PORT, not a list")
        return EndpointSpec("c10d", (_split_host_port(rest, DEFAULT_C10D_PORT, endpoint),))
    if scheme in _ETCD_SCHEMES:
        items = [_split_host_port(i, DEFAULT_ETCD_PORT, endpoint) for i in rest.split(",")]
        return EndpointSpec("etcd", tuple(dict.fromkeys(items)), tls=_ETCD_SCHEMES[scheme])
    raise UsageError(
        f"rendezvous endpoint {endpoint!r}: unknown scheme {scheme!r} (use tcp://, etcd://, etcds:// or https://)"
    )
