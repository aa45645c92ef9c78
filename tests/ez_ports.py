"""The one rule for picking a free TCP port, shared by the tests (through ``ez_testing``) and the benchmarks.

Standard library only: the benchmarks also run it inside the optional DeepSpeed venv (``bench/_ds_venv.sh``), which
has neither elasticzero nor pytest. A benchmark puts ``tests/`` on ``sys.path`` to import it.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

_PORTS_HANDED_OUT = itertools.count()
_PORT_WINDOW = 12000  # ports just below the kernel's ephemeral range that free_port hands out


def _bindable(host: str, port: int) -> int:
    with socket.socket() as s:
        s.bind((host, port))
        return int(s.getsockname()[1])


def _below_ephemeral() -> tuple[int, int] | None:
    """``[lo, hi)``: the ports just below ``ip_local_port_range``, or None if that leaves too few."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (first - _PORT_WINDOW, first) if first - _PORT_WINDOW >= 10000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` that nothing else takes before the caller's server binds it.

    A port found free by ``bind(0)`` is in the kernel's ephemeral range, which the kernel also hands to every
    outgoing connection (gRPC, TCPStore and gloo clients of earlier tests) and every other ``bind(0)``: one of those
    can take it before etcd or a TCPStore binds it ("bind: address already in use", seen under load). So ports come
    from just below that range, never the same one twice in a process (a restarted server reuses its own on
    purpose), starting at a pid-dependent offset for other processes doing the same, each checked bindable.
    """
    window = _below_ephemeral()
    if window is None:
        return _bindable(host, 0)
    lo, hi = window
    for _ in range(hi - lo):
        port = lo + (os.getpid() * 7919 + next(_PORTS_HANDED_OUT)) % (hi - lo)
        try:
            return _bindable(host, port)
        except OSError:
            continue
    raise RuntimeError(f"no free port in {lo}-{hi - 1} on {host}")
