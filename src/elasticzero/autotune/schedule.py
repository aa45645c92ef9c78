"""Scheduling decisions as pure functions: the queue and the pool's state in, the experiments to start out.

:func:`decide` walks the queue in priority order and gives each experiment the reservation the
:class:`~elasticzero.autotune.resources.ResourceManager` would grant now, plus its own rendezvous port; it stops at
the first experiment that does not fit (first come, first served: a large experiment is never starved by small
ones behind it). It changes nothing: the caller reserves what it actually starts.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from elasticzero.autotune.resources import Request, Reservation, ResourceManager

__all__ = ["PORT_SPAN", "Start", "decide", "pick_port"]

#: rendezvous ports are taken from ``base … base + PORT_SPAN - 1``, round robin
PORT_SPAN = 1000


@dataclass(frozen=True)
class Start:
    """Start experiment ``key`` on ``reservation`` with its rendezvous on ``port``."""

    key: str
    reservation: Reservation
    port: int


def pick_port(base: int, counter: int, in_use: Collection[int]) -> tuple[int, int]:
    """``(port, next counter)``: the next port after ``counter`` not used by a running experiment.

    Ports advance round robin, so a finished experiment's port (possibly in TIME_WAIT) is not reused at once.
    """
    for step in range(PORT_SPAN):
        port = base + (counter + step) % PORT_SPAN
        if port not in in_use and port <= 65535:
            return port, counter + step + 1
    raise RuntimeError(f"no free rendezvous port in {base}-{base + PORT_SPAN - 1}")


def decide(
    queue: Sequence[tuple[str, Request]],
    manager: ResourceManager,
    *,
    running: int,
    max_running: int | None,
    base_port: int,
    port_counter: int,
    ports_in_use: Collection[int],
) -> tuple[list[Start], int]:
    """The experiments to start now, and the port counter after them (see the module docstring)."""
    trial = manager.copy()
    used = set(ports_in_use)
    starts: list[Start] = []
    for key, request in queue:
        if max_running is not None and running + len(starts) >= max_running:
            break
        reservation = trial.find(request)
        if reservation is None:
            break
        trial.reserve(reservation)
        port, port_counter = pick_port(base_port, port_counter, used)
        used.add(port)
        starts.append(Start(key, reservation, port))
    return starts, port_counter
