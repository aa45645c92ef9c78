"""Hostfiles: ``HOST slots=N`` lines into an ordered resource pool.

Format (DeepSpeed's, stricter)::

    # comment
    worker-0 slots=4      # trailing comment
    10.0.0.7 slots=2

Decisions, each reported as one :class:`~elasticzero.errors.UsageError` naming ``file:line`` and the fix:

* every host line needs ``slots=N`` with N a positive integer; ``slots`` is the only key;
* a host may appear once (compared case-insensitively);
* host names are DNS-style names (letters, digits, ``.``, ``_``, ``-``; not starting with ``-`` so a name can never
  become an option of ssh/pdsh/mpirun) or IPv4 addresses;
* IPv6 literals are refused: pdsh ``-w``, mpirun ``-H`` and Slurm node lists give ``:`` its own meaning, so no
  shipped transport could reach such a host. The message says the fix: a name for it in ``/etc/hosts`` (or DNS);
* ``user@host`` is rejected: the user belongs in ``~/.ssh/config`` (``Host worker-0`` / ``User alice``), which pdsh,
  ssh and mpirun all honour, and the host name must stay a plain name that every node can match itself against;
* a file without any host line is an error.

Parsing is a pure function (:func:`parse_hostfile`); :func:`read_hostfile` adds the file I/O.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from elasticzero.errors import UsageError

#: host name -> slot ids, in hostfile order
ResourcePool = dict[str, tuple[int, ...]]

HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
"""The one rule for a host name a transport cannot misread: DNS-style names and IPv4 addresses (letters, digits,
``.``, ``-``, ``_``; no leading or trailing ``-``/``.``). The hostfile and every backend's host check use it."""
_INT = re.compile(r"[+-]?\d+")


def normalize_host(host: str) -> str | None:
    """``host`` in canonical form, or ``None`` when it is neither a DNS-style name nor an IP literal.

    Brackets around an IPv6 literal are removed and the literal is compressed (``[FE80::0001]`` → ``fe80::1``).
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare:
        try:
            return str(ipaddress.IPv6Address(bare))
        except ValueError:
            return None
    if bare is not host:  # brackets are only for IPv6 literals
        return None
    return host if HOST_NAME.fullmatch(host) else None


#: names that mean "this machine" by convention (RFC 6761 ``localhost``, Debian's /etc/hosts names for ``::1``)
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def host_key(host: str) -> str:
    """The key under which two spellings of one host compare equal: case-folded, IPv6 literals normalised.

    ``Worker-0`` and ``worker-0`` share a key (DNS names are case-insensitive), as do ``[FE80::0001]`` and
    ``fe80::1``. Text that is not a valid host is only case-folded.
    """
    return (normalize_host(host) or host).lower()


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface by its text alone (no DNS lookup).

    True for ``localhost`` (and ``*.localhost``, ``localhost.localdomain``, ``ip6-localhost``, ``ip6-loopback``),
    any address in ``127.0.0.0/8``, ``::1`` and IPv4-mapped loopback (``::ffff:127.0.0.1``), in any case and with
    or without IPv6 brackets.
    """
    key = host_key(host).rstrip(".")
    if key in _LOOPBACK_NAMES or key.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(key)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def host_problem(host: str) -> str:
    """Why ``host`` is not an acceptable host name, with the fix (for error messages)."""
    if "@" in host:
        return (
            f"'user@host' is not supported ({host!r}); write the bare host and set the user in ~/.ssh/config "
            "(Host NAME / User USER)"
        )
    if host.startswith("-"):
        return f"host name {host!r} starts with '-'; host names must be DNS names or IP addresses"
    if ":" in host:
        return f"{host!r} is not a valid IPv6 address"
    return f"invalid host name {host!r}; use a DNS name (letters, digits, '.', '_', '-') or an IP address"


def ipv6_problem(host: str) -> str:
    """Why an IPv6 literal cannot be a launch host, with the fix (for error messages)."""
    return (
        f"IPv6 address {host!r} cannot be a host: pdsh -w, mpirun -H and Slurm node lists read ':' as a separator; "
        "give it a name in /etc/hosts (or DNS) on every node, e.g. '<address> node-v6-1', and write that name here"
    )


def parse_hostfile(text: str, source: str) -> ResourcePool:
    """Parse hostfile ``text`` (read from ``source``, used in messages) into host → slot ids ``(0 … N-1)``."""
    pool: ResourcePool = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        tokens = line.split()
        host_text, pairs = tokens[0], tokens[1:]
        if "=" in host_text:
            raise UsageError(f"{where}: line must start with a host name, got {host_text!r}; expected 'HOST slots=N'")
        host = normalize_host(host_text)
        if host is None:
            raise UsageError(f"{where}: {host_problem(host_text)}")
        if ":" in host:
            raise UsageError(f"{where}: {ipv6_problem(host_text)}")
        slots = _parse_pairs(host_text, pairs, where)
        key = host_key(host)
        if key in first_line:
            raise UsageError(
                f"{where}: duplicate host {host_text!r} (first at line {first_line[key]}); list each host once "
                "with its total slots"
            )
        first_line[key] = lineno
        pool[host] = tuple(range(slots))
    if not pool:
        raise UsageError(f"{source}: hostfile has no hosts; add lines like 'worker-0 slots=4'")
    return pool


def _parse_pairs(host: str, pairs: list[str], where: str) -> int:
    """The slot count from a host line's ``key=value`` tokens."""
    slots: int | None = None
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise UsageError(f"{where}: unexpected {pair!r}; expected 'HOST slots=N'")
        if key != "slots":
            raise UsageError(f"{where}: unknown key {key!r}; the only key is 'slots' (e.g. 'worker-0 slots=4')")
        if slots is not None:
            raise UsageError(f"{where}: 'slots' given twice; give it once")
        if not _INT.fullmatch(value):
            raise UsageError(f"{where}: slots={value!r} is not a number; use a positive integer like slots=4")
        slots = int(value)
        if slots <= 0:
            raise UsageError(f"{where}: slots={value} must be a positive integer; remove the host to leave it out")
    if slots is None:
        raise UsageError(f"{where}: missing slots=N for {host!r}; write e.g. '{host} slots=4'")
    return slots


def read_hostfile(path: str | Path) -> ResourcePool:
    """Read and parse the hostfile at ``path``; a missing or unreadable file is a :class:`UsageError`."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UsageError(
            f"hostfile {str(p)!r} not found; fix the path or omit --hostfile to run on localhost"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read hostfile {str(p)!r}: {exc}") from None
    return parse_hostfile(text, str(p))
