"""The node table the front-end hands every agent, and how an agent finds itself in it.

``--node-table`` is JSON ``[[host, [slot, …]], …]`` in node-rank order (see
:meth:`elasticzero.launch.plan.LaunchPlan.node_table_json`). An agent learns its row from ``--node-rank N``,
``--node-rank-env VAR``, ``--node-host NAME`` or ``--node-host-env VAR``; with none of them it matches its own
host name, then its interface addresses, against the table. Every decision here is a pure function over its
inputs (the host facts are gathered by :func:`local_host_facts`), so it is tested without a network.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from elasticzero.errors import UsageError


@dataclass(frozen=True)
class NodeRow:
    """One row of the node table: the host as the user wrote it and the slot ids bound there."""

    host: str
    slots: tuple[int, ...]


@dataclass(frozen=True)
class HostFacts:
    """What this machine calls itself: host names (short and FQDN) and interface addresses."""

    names: frozenset[str]
    addresses: frozenset[str]


def parse_node_table(text: str) -> tuple[NodeRow, ...]:
    """Parse ``--node-table`` JSON; any malformation is a :class:`UsageError` naming the problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--node-table is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, list) or not data:
        raise UsageError("--node-table must be a non-empty JSON list [[host, [slot, ...]], ...]")
    rows: list[NodeRow] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]):
            raise UsageError(f"--node-table entry {i} must be [host, [slot, ...]], got {json.dumps(entry)}")
        host, slots = entry
        if not isinstance(slots, list) or not slots:
            raise UsageError(f"--node-table entry {i} ({host}) needs a non-empty slot list")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots):
            raise UsageError(f"--node-table entry {i} ({host}) has slots that are not non-negative integers")
        if len(set(slots)) != len(slots):
            raise UsageError(f"--node-table entry {i} ({host}) repeats a slot id")
        if host in seen:
            raise UsageError(f"--node-table lists host {host!r} twice")
        seen.add(host)
        rows.append(NodeRow(host, tuple(slots)))
    return tuple(rows)


def bare_host(host: str) -> str:
    """``user@host`` → ``host``; ``[v6]`` → ``v6``."""
    host = host.rsplit("@", 1)[-1]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def rank_from_env(var: str, env: Mapping[str, str]) -> int:
    """The integer node rank held by environment variable ``var`` (``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, …)."""
    value = env.get(var)
    if value is None:
        raise UsageError(f"--node-rank-env {var}: the variable is not set in this environment")
    try:
        return int(value.strip())
    except ValueError:
        raise UsageError(f"--node-rank-env {var}: value {value!r} is not an integer") from None


def rank_of_host(name: str, table: Sequence[NodeRow], flag: str) -> int:
    """The row whose host is ``name`` (exact, then ignoring ``user@`` and the domain part)."""
    exact = [i for i, r in enumerate(table) if bare_host(r.host) == name or r.host == name]
    if len(exact) == 1:
        return exact[0]
    short = name.split(".")[0]
    loose = [i for i, r in enumerate(table) if bare_host(r.host).split(".")[0] == short]
    if len(loose) == 1:
        return loose[0]
    hosts = ", ".join(r.host for r in table)
    if not loose:
        raise UsageError(f"{flag} {name!r} is not in the node table ({hosts})")
    raise UsageError(f"{flag} {name!r} matches several node-table hosts ({hosts}); use --node-rank")


def match_local_host(table: Sequence[NodeRow], facts: HostFacts, resolve: Mapping[str, Iterable[str]]) -> int:
    """Find this machine's row by host name, then by address (``resolve``: table host → its addresses)."""
    by_name = [i for i, r in enumerate(table) if bare_host(r.host) in facts.names]
    if len(by_name) == 1:
        return by_name[0]
    hosts = ", ".join(r.host for r in table)
    if len(by_name) > 1:
        raise UsageError(f"this host matches several node-table entries by name ({hosts}); pass --node-rank")
    by_addr = [i for i, r in enumerate(table) if facts.addresses & set(resolve.get(r.host, ()))]
    if len(by_addr) == 1:
        return by_addr[0]
    if len(by_addr) > 1:
        raise UsageError(f"this host's addresses match several node-table entries ({hosts}); pass --node-rank")
    names = ", ".join(sorted(facts.names))
    raise UsageError(f"this host ({names}) is not in the node table ({hosts}); pass --node-rank or --node-host")


def local_host_facts() -> HostFacts:
    """Gather this machine's host names and interface addresses (psutil)."""
    import psutil

    names = {socket.gethostname(), socket.getfqdn()}
    names |= {n.split(".")[0] for n in names}
    addrs: set[str] = set()
    for snics in psutil.net_if_addrs().values():
        for snic in snics:
            if snic.family in (socket.AF_INET, socket.AF_INET6):
                addrs.add(snic.address.split("%")[0])
    return HostFacts(frozenset(n for n in names if n), frozenset(addrs))


def resolve_hosts(table: Sequence[NodeRow]) -> dict[str, set[str]]:
    """Resolve each table host to its addresses; unresolvable hosts map to an empty set."""
    out: dict[str, set[str]] = {}
    for row in table:
        try:
            infos = socket.getaddrinfo(bare_host(row.host), None)
        except (socket.gaierror, UnicodeError):
            out[row.host] = set()
            continue
        out[row.host] = {str(info[4][0]).split("%")[0] for info in infos}
    return out
