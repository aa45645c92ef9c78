"""Buddy placement: which rank holds the copy of which rank's ZeRO shard (pure decisions, no torch).

Every rank's ZeRO state (fp32 masters, optimizer moments, step counters) has one copy on its *holder*, a rank of
another node, so that losing one node loses at most one of the two copies of any shard. The placement is a ring over
nodes: nodes in order of their first rank, rank ``r`` (the ``j``-th rank of node ``i``) is held by the ``j``-th rank
(modulo that node's size) of node ``(i + node_shift) mod K``. With equal nodes every rank holds exactly one copy; with
uneven ones a rank of a small node may hold more. With one node, or replication off, nobody holds anything (a copy on
the same node dies with it) and :attr:`BuddyPlan.reason` says why.

:func:`shift_for` is the knob's rule per round: a ``node_shift`` that is a multiple of a round's node count would put
copies on their own node, so that round uses shift 1 (and says so in the plan's ``reason``) rather than stopping a
running job at a world size its config could not foresee; :func:`place_buddies` is the decision over a snapshot of the
group (the node of every rank, e.g. gathered from ``GROUP_RANK`` or the host name).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from elasticzero.errors import UsageError


@dataclass(frozen=True)
class BuddyPlan:
    """``holder[r]``: the rank holding rank ``r``'s copy (``None`` for all when off, with ``reason``)."""

    holder: tuple[int | None, ...]
    reason: str = ""  #: why nobody holds a copy, or why this round's shift is not the knob's

    @property
    def enabled(self) -> bool:
        return any(h is not None for h in self.holder)

    def wards(self, rank: int) -> tuple[int, ...]:
        """The ranks whose copies ``rank`` holds, in rank order."""
        return tuple(r for r, h in enumerate(self.holder) if h == rank)


def shift_for(node_shift: int, nodes: int) -> tuple[int, str]:
    """The shift a round of ``nodes`` nodes uses, and why when it is not ``node_shift`` (>= 1; ``nodes`` >= 2)."""
    if node_shift < 1:
        raise UsageError(f"buddy copies: node_shift={node_shift}: must be >= 1 (default 1)")
    if node_shift % nodes:
        return node_shift, ""
    return 1, f"node_shift={node_shift} is a multiple of this round's {nodes} nodes (copies on their own node): shift 1"


def place_buddies(nodes: Sequence[Hashable], *, enabled: bool = True, node_shift: int = 1) -> BuddyPlan:
    """The holder of every rank's copy, given ``nodes[r]`` (the node of rank ``r``)."""
    off = (None,) * len(nodes)
    order = list(dict.fromkeys(nodes))
    if not enabled:
        return BuddyPlan(off, "replication is off")
    if len(order) < 2:
        return BuddyPlan(off, "one node: a copy on the same node would die with it")
    shift, why = shift_for(node_shift, len(order))
    ranks_of = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    holder = []
    for r, n in enumerate(nodes):
        there = ranks_of[order[(order.index(n) + shift) % len(order)]]
        holder.append(there[ranks_of[n].index(r) % len(there)])
    return BuddyPlan(tuple(holder), why)
