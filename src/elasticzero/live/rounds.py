"""The round source the workers watch: one key in a c10d store, hosted outside the ranks (by the agent), naming the
current round of the job.

A round is a number, its members (``old rank -> new rank``: a rank of the previous round's group and its rank in
the new one; old ranks absent from it are gone) and the store prefix the round's keys live under. The agent writes it
(:func:`announce`) when membership changes; every worker reads it while a collective waits (:class:`RoundSource`,
thin I/O) and decides over the bytes it read (:func:`decide`, pure): nothing new, a newer round, or a
:class:`RoundError` — errors as data, never an exception from the reader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

ROUND_KEY = "elasticzero/live/round"


@dataclass(frozen=True)
class Round:
    """Round ``number``: ``members``, ``(old_rank, new_rank)`` pairs in new-rank order; ``prefix``, its store prefix."""

    number: int
    members: tuple[tuple[int, int], ...]
    prefix: str

    @property
    def world_size(self) -> int:
        return len(self.members)

    def new_rank(self, old_rank: int) -> int | None:
        """This old rank's rank in the round (``None``: not a member)."""
        return dict(self.members).get(old_rank)

    def old_ranks(self) -> list[int]:
        """The members' old ranks, in new-rank order."""
        return [old for old, _ in self.members]

    def to_json(self) -> str:
        members = {str(o): n for o, n in self.members}
        return json.dumps({"round": self.number, "members": members, "prefix": self.prefix})


@dataclass(frozen=True)
class RoundError:
    """The round key holds something that is not a round: ``reason`` names the key and what is wrong."""

    reason: str


def parse_round(raw: bytes) -> Round | RoundError:
    """The round in ``raw`` (the key's JSON), or what is wrong with it."""
    try:
        doc: Any = json.loads(raw)
        number, members, prefix = doc["round"], doc["members"], doc["prefix"]
        pairs = sorted(((int(o), int(n)) for o, n in members.items()), key=lambda p: p[1])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return RoundError(f"{ROUND_KEY}: not a round ({err!r}); want {{round, members: {{old: new}}, prefix}}")
    return _checked(number, tuple(pairs), prefix)


def _checked(number: Any, pairs: tuple[tuple[int, int], ...], prefix: Any) -> Round | RoundError:
    if not isinstance(number, int) or number < 0:
        return RoundError(f"{ROUND_KEY}: round {number!r} is not a non-negative integer")
    if [n for _, n in pairs] != list(range(len(pairs))) or min((o for o, _ in pairs), default=0) < 0:
        return RoundError(f"{ROUND_KEY}: round {number}'s new ranks {[n for _, n in pairs]} are not 0..M-1 once each")
    if not isinstance(prefix, str) or not prefix:
        return RoundError(f"{ROUND_KEY}: round {number} has no store prefix")
    return Round(number, pairs, prefix)


def decide(raw: bytes | None, current: int) -> Round | RoundError | None:
    """What a worker at round ``current`` makes of the key's bytes: ``None`` (absent, or not newer), the newer round,
    or a :class:`RoundError`."""
    if raw is None:
        return None
    found = parse_round(raw)
    return found if isinstance(found, RoundError) or found.number > current else None


class RoundSource:
    """Reads the round key of a c10d ``store`` (never blocks on a missing key)."""

    def __init__(self, store: Any, key: str = ROUND_KEY) -> None:
        self.store = store
        self.key = key

    def read(self) -> bytes | None:
        return self.store.get(self.key) if self.store.check([self.key]) else None

    def poll(self, current: int) -> Round | RoundError | None:
        """:func:`decide` over what the key holds now."""
        return decide(self.read(), current)


def announce(store: Any, round_: Round, key: str = ROUND_KEY) -> None:
    """Publish ``round_`` (the agent's side; a test harness standing in for it)."""
    store.set(key, round_.to_json())


# -- the agent's hand-off: one round file per node ------------------------------------------------------------------
#: the worker environment variable naming this node's round file (set by the agent in live mode)
ROUND_FILE_ENV = "ELASTICZERO_ROUND_FILE"


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
