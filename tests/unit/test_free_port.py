"""``ez_testing.free_port``: ports a server can still bind when the test gets to it (see its docstring)."""

from __future__ import annotations

import socket
from pathlib import Path

from ez_testing import free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(p < first_ephemeral for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
        s.listen()


def _hold_the_next_port() -> tuple[socket.socket, int]:
    """A listener on the port ``free_port`` hands out next (they come in order; retried past a wrap or a busy one)."""
    for _ in range(10):
        nxt = free_port() + 1
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", nxt))
        except OSError:
            held.close()
            continue
        held.listen()
        return held, nxt
    raise AssertionError("could not hold the next port")


def test_a_port_someone_listens_on_is_skipped() -> None:
    held, nxt = _hold_the_next_port()
    with held:
        got = free_port()
        assert got != nxt
        with socket.socket() as s:
            s.bind(("127.0.0.1", got))
