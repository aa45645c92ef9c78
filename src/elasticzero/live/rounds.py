"""The round the workers are in: one file per node, written by the node's agent, read by its workers.

A round (:class:`NodeRound`) is a number, the round's world size, the new global ranks of this node's workers (by
local rank), the c10d store every member meets on and a store prefix no other round uses: every round, the first one
too, is a fresh default process group formed there (:mod:`.group`). The agent writes the file at
``$ELASTICZERO_ROUND_FILE`` (:data:`ROUND_FILE_ENV`) before its workers start and again at every membership change
(:func:`write_round`: whole, then renamed into place); every worker reads it between steps and while a collective
waits (:class:`RoundFile`, thin I/O: one ``stat`` per poll when unchanged) and decides over the bytes it read
(:func:`decide_node`, pure): nothing new, a newer round, or a :class:`RoundError` — errors as data, never an exception
from the reader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

#: the worker environment variable naming this node's round file (set by the agent in live mode)
ROUND_FILE_ENV = "ELASTICZERO_ROUND_FILE"


@dataclass(frozen=True)
class RoundError:
    """The round file holds something that is not a round: ``reason`` names the file and what is wrong."""

    reason: str


@dataclass(frozen=True)
class StoreAddress:
    """Where a round's workers meet: a c10d ``TCPStore`` at ``host:port``; ``rank0_hosts``: the round's new rank 0
    creates it (torch's etcd rendezvous), else a node's agent already serves it (c10d: the rendezvous store)."""

    host: str
    port: int
    rank0_hosts: bool


@dataclass(frozen=True)
class NodeRound:
    """Round ``number`` as one node's agent hands it to its workers (the file at :data:`ROUND_FILE_ENV`).

    ``ranks``: ``(local_rank, new_global_rank)`` of this node's workers in the round; ``world_size``: the round's;
    ``store``/``prefix``: where every member (survivors and fresh joiners alike) forms the round's default group —
    ``PrefixStore(prefix, TCPStore(store.host, store.port))``, a prefix no other round uses.
    """

    number: int
    world_size: int
    ranks: tuple[tuple[int, int], ...]
    store: StoreAddress
    prefix: str

    def rank_of(self, local_rank: int) -> int | None:
        """The new global rank of this node's ``local_rank`` (``None``: not in the round)."""
        return dict(self.ranks).get(local_rank)

    def to_json(self) -> str:
        store = {"host": self.store.host, "port": self.store.port, "rank0_hosts": self.store.rank0_hosts}
        ranks = {str(local): new for local, new in self.ranks}
        doc = {"round": self.number, "world_size": self.world_size, "ranks": ranks, "store": store}
        return json.dumps({**doc, "prefix": self.prefix})


def parse_node_round(raw: bytes, where: str = ROUND_FILE_ENV) -> NodeRound | RoundError:
    """The round in ``raw`` (a round file's JSON), or what is wrong with it (``where`` names the file)."""
    try:
        doc: Any = json.loads(raw)
        s = doc["store"]
        store = StoreAddress(str(s["host"]), int(s["port"]), bool(s["rank0_hosts"]))
        ranks = tuple(sorted((int(k), int(v)) for k, v in doc["ranks"].items()))
        number, world, prefix = doc["round"], doc["world_size"], doc["prefix"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        want = "{round, world_size, ranks: {local: new}, store: {host, port, rank0_hosts}, prefix}"
        return RoundError(f"{where}: not a round ({err!r}); want {want}")
    return _checked_node(where, number, world, ranks, store, prefix)


def _checked_node(
    where: str, number: Any, world: Any, ranks: tuple[tuple[int, int], ...], store: StoreAddress, prefix: Any
) -> NodeRound | RoundError:
    if not isinstance(number, int) or number < 0 or not isinstance(world, int) or world < 1:
        return RoundError(f"{where}: round {number!r} / world_size {world!r} are not a round number and a world size")
    news = [n for _, n in ranks]
    if len(set(news)) != len(news) or any(not 0 <= n < world for n in news):
        return RoundError(f"{where}: round {number}'s ranks {news} are not distinct ranks below {world}")
    if not isinstance(prefix, str) or not prefix or not 0 < store.port < 65536:
        return RoundError(f"{where}: round {number} has no store prefix or a bad store port {store.port}")
    return NodeRound(number, world, ranks, store, prefix)


def decide_node(raw: bytes | None, current: int, where: str = ROUND_FILE_ENV) -> NodeRound | RoundError | None:
    """What a worker at round ``current`` makes of its round file's bytes: ``None`` (absent, or not newer), the newer
    round, or a :class:`RoundError`."""
    if raw is None:
        return None
    found = parse_node_round(raw, where)
    return found if isinstance(found, RoundError) or found.number > current else None


class RoundFile:
    """This node's round file (written by the agent, read by its workers; one ``stat`` per poll when unchanged)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None  #: (inode, mtime_ns, size) of the last read
        self._raw: bytes | None = None

    def read(self) -> bytes | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        if self._seen != (st.st_ino, st.st_mtime_ns, st.st_size):
            with open(self.path, "rb") as f:
                self._raw, self._seen = f.read(), (st.st_ino, st.st_mtime_ns, st.st_size)
        return self._raw

    def poll(self, current: int) -> NodeRound | RoundError | None:
        """:func:`decide_node` over what the file holds now."""
        return decide_node(self.read(), current, self.path)


def write_round(path: str, round_: NodeRound) -> None:
    """Publish ``round_`` to this node's workers (the agent's side): written whole, then renamed into place, so a
    reader sees the old round or the new one, never a part."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(round_.to_json())
    os.replace(tmp, path)
