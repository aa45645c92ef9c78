"""Node-rank ordering: re-assign torch's group ranks so they follow a given order (hostfile order).

torch's dynamic rendezvous ranks nodes by sorted ``(addr, pid, local_id)``. Each agent may carry a
``node_rank_hint`` (an int from the front-end). Every node publishes its hint in the run's store under its own
rendezvous identity *before* it joins a round, so when a round completes the hint of every participant is already
there: each node reads them (no waiting) and applies the same pure function, and all agree on the new ranks without
another round — even when a participant dies right after the round completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed import Store

HINT_KEY_PREFIX = "elasticzero/node_rank_hint/"
_NO_HINT = "-"


def order_ranks(hints: Sequence[int | None]) -> list[int]:
    """New rank of each node, indexed by torch's rank: sort by (hint, torch rank); nodes without a hint go last."""
    order = sorted(range(len(hints)), key=lambda r: (hints[r] is None, hints[r] or 0, r))
    new_rank = [0] * len(hints)
    for position, torch_rank in enumerate(order):
        new_rank[torch_rank] = position
    return new_rank


def encode_hint(hint: int | None) -> str:
    """Wire form of a hint in the store."""
    return _NO_HINT if hint is None else str(hint)


def decode_hint(raw: bytes | str) -> int | None:
    """Inverse of :func:`encode_hint` (the store hands back bytes)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return None if text == _NO_HINT else int(text)


def hint_key(run_id: str, node: Any) -> str:
    """Store key of the hint of ``node`` (torch's node descriptor: ``addr``, ``pid``, ``local_id``) in ``run_id``."""
    return f"{HINT_KEY_PREFIX}{run_id}/{node.addr}_{node.pid}_{node.local_id}"


def publish_hint(store: Store, run_id: str, node: Any, hint: int | None) -> None:
    """Write the hint of ``node`` (this one, before it joins a round: see the module docstring)."""
    store.set(hint_key(run_id, node), encode_hint(hint))


def read_hints(store: Store, keys: Sequence[str]) -> list[int | None]:
    """The hints under ``keys``, never waiting: a key nobody wrote (a node that publishes none) reads as no hint."""
    present = list(keys) if store.check(list(keys)) else [k for k in keys if store.check([k])]
    values = dict(zip(present, store.multi_get(present), strict=True)) if present else {}
    return [decode_hint(bytes(values[k])) if k in values else None for k in keys]


def ranks_by_hint(store: Store, run_id: str, participants: dict[Any, int]) -> dict[Any, int]:
    """The new rank of each participant (torch's ``{node: rank}`` of a completed round), from the published hints."""
    nodes = sorted(participants, key=participants.__getitem__)  # torch rank order
    if len(nodes) <= 1:
        return dict(participants)
    new_rank = order_ranks(read_hints(store, [hint_key(run_id, n) for n in nodes]))
    return {n: new_rank[i] for i, n in enumerate(nodes)}
