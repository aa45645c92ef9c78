"""Node-rank ordering: re-assign torch's group ranks so they follow a given order (hostfile order).

torch's dynamic rendezvous ranks nodes by sorted ``(addr, pid, local_id)``. Each agent may carry a
``node_rank_hint`` (an int from the front-end); after torch's round completes every node publishes its hint in the
round's store and all nodes apply the same pure function, so they agree on the new ranks without another round.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def exchange_and_order(store: Store, rank: int, world_size: int, hint: int | None) -> int:
    """Publish our hint under the round's store, read everyone's, and return our re-assigned rank."""
    if world_size <= 1:
        return rank
    store.set(f"{HINT_KEY_PREFIX}{rank}", encode_hint(hint))
    raw = store.multi_get([f"{HINT_KEY_PREFIX}{r}" for r in range(world_size)])
    return order_ranks([decode_hint(bytes(v)) for v in raw])[rank]
