"""Nodes, reservations and the resource manager over the pool ``elasticzero-launch`` discovers.

The pool comes from the launcher's own discovery and filters (hostfile / Slurm allocation / local slots, then
``-i``/``-e``/``--num-nodes``/``--num-gpus``: :func:`elasticzero.launch.resources.select_pool`), never from a second
implementation. The manager is pure bookkeeping: which slots of which host are reserved by which experiment.

Timing rule: on one host, experiments share the CPU cores (and memory bandwidth, PCIe, …) even when their slots
differ, so their measurements disturb each other. By default a host therefore serves one experiment at a time;
``share_hosts`` lets experiments take the free slots of a busy host. Experiments on disjoint hosts always may run
together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from elasticzero.errors import UsageError

__all__ = ["Node", "Request", "Reservation", "ResourceManager"]


@dataclass(frozen=True)
class Node:
    """A host and its slot ids (GPU indices, or CPU process slots)."""

    host: str
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Request:
    """How much one experiment needs: ``nodes`` hosts with ``slots_per_node`` slots each."""

    nodes: int
    slots_per_node: int


@dataclass(frozen=True)
class Reservation:
    """Slots on one or more nodes, in pool order (the first node hosts the rendezvous)."""

    nodes: tuple[Node, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(n.host for n in self.nodes)

    @property
    def world_size(self) -> int:
        return sum(len(n.slots) for n in self.nodes)

    def hostfile(self) -> str:
        """A hostfile naming exactly these hosts (slots up to the highest reserved id)."""
        return "".join(f"{n.host} slots={max(n.slots) + 1}\n" for n in self.nodes)

    def include(self) -> str:
        """The ``-i`` filter selecting exactly the reserved slots of that hostfile."""
        return "@".join(f"{_bracket(n.host)}:{','.join(map(str, n.slots))}" for n in self.nodes)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ResourceManager:
    """The pool's nodes and which slots are reserved (see the module docstring for the sharing rule)."""

    def __init__(self, nodes: Sequence[Node], share_hosts: bool = False) -> None:
        if not nodes:
            raise UsageError("the resource pool is empty; check the hostfile or --include/--exclude")
        self.nodes = tuple(nodes)
        self.share_hosts = share_hosts
        self._used: dict[str, set[int]] = {n.host: set() for n in self.nodes}

    @classmethod
    def from_pool(cls, pool: Mapping[str, Iterable[int]], share_hosts: bool = False) -> ResourceManager:
        """From the launcher's ``ResourcePool`` (host → slot ids, in node order)."""
        return cls([Node(host, tuple(slots)) for host, slots in pool.items()], share_hosts)

    def default_request(self, nodes: int | None, slots_per_node: int | None) -> Request:
        """The request for ``nodes`` x ``slots_per_node`` (default: every node, the fewest slots any has)."""
        n = len(self.nodes) if nodes is None else nodes
        k = min(len(node.slots) for node in self.nodes) if slots_per_node is None else slots_per_node
        return Request(n, k)

    def check(self, request: Request) -> None:
        """A request the whole (idle) pool could never satisfy is a :class:`UsageError`."""
        fitting = [n for n in self.nodes if len(n.slots) >= request.slots_per_node]
        if len(fitting) < request.nodes:
            sizes = ", ".join(f"{n.host}:{len(n.slots)}" for n in self.nodes)
            raise UsageError(
                f"an experiment needs {request.nodes} node(s) x {request.slots_per_node} slot(s) but the pool has "
                f"{sizes}; lower autotuning.nodes / slots_per_node or add hosts"
            )

    def free_slots(self, host: str) -> tuple[int, ...]:
        """Slots of ``host`` an experiment may take now (none on a busy host unless hosts are shared)."""
        node = next(n for n in self.nodes if n.host == host)
        used = self._used[host]
        if used and not self.share_hosts:
            return ()
        return tuple(s for s in node.slots if s not in used)

    def find(self, request: Request) -> Reservation | None:
        """The reservation ``request`` would get now (the first fitting nodes, lowest slot ids), or ``None``."""
        chosen = []
        for node in self.nodes:
            free = self.free_slots(node.host)
            if len(free) >= request.slots_per_node:
                chosen.append(Node(node.host, free[: request.slots_per_node]))
                if len(chosen) == request.nodes:
                    return Reservation(tuple(chosen))
        return None

    def reserve(self, reservation: Reservation) -> None:
        for node in reservation.nodes:
            taken = self._used[node.host] & set(node.slots)
            if taken:
                raise RuntimeError(f"slots {sorted(taken)} of {node.host} are already reserved")
            self._used[node.host] |= set(node.slots)

    def release(self, reservation: Reservation) -> None:
        for node in reservation.nodes:
            self._used[node.host] -= set(node.slots)

    def copy(self) -> ResourceManager:
        other = ResourceManager(self.nodes, self.share_hosts)
        other._used = {h: set(s) for h, s in self._used.items()}
        return other
