"""The live-round protocol between a node's agent and its workers — its store keys, its file and its steps — in one
module: the agent→worker contract, beside :mod:`elasticzero.progress` (the worker→agent one). The agent
(:mod:`elasticzero.agent.handoff`) and the workers (:mod:`elasticzero.live`) both import it; it imports nothing of
either.

A round (:class:`NodeRound`) is a number, the round's world size, the new global ranks of this node's workers (by
local rank), the c10d store every member meets on and a store prefix no other round uses (:func:`round_prefix`):
every round, the first one too, is a fresh default process group formed there (:mod:`elasticzero.live.group`).

The steps of one round:

1. **agree** (the round's agents, over the new rendezvous round's store): each sets the number of the last round it
   handed out (:data:`NO_ROUND`: none, a fresh joiner) under :func:`last_round_key` of its group rank, waits for all
   of them, and takes :func:`next_round_number` — the same number on every node, above any round a running worker
   has seen, so the round's prefix is new in the job's store;
2. **write** (each agent, before it starts or keeps its workers): this node's round file at
   ``$ELASTICZERO_ROUND_FILE`` (:data:`ROUND_FILE_ENV`; :func:`write_round`: whole, then renamed into place);
3. **read** (each worker, between steps and while a collective waits): :class:`RoundFile` (thin I/O: one ``stat``
   per poll when unchanged) and :func:`decide_node` (pure) over the bytes read: nothing new, a newer round, or a
   :class:`RoundError` — errors as data, never an exception from the reader;
4. **ready** (each member, on ``PrefixStore(round.prefix, TCPStore(round.store))``): it sets its :func:`ready_key`
   — a member of the old round as soon as it read the new one, a fresh process (a joiner's worker) once it started
   and reached the round's formation — and a member of the old round goes on training there until every member's
   key is set: a join pauses nobody while the joiner's interpreter, torch and script start;
5. **switch**: the first member that finds every ready key set decides when the old round's members switch and
   compare-sets it under :data:`SWITCH_KEY`; every member adopts what is there, whatever it reads later (one decision
   over one snapshot of the keys: members that read them at different moments never part). Where every member of the
   old round is in the new one (:func:`joins_only`, over the ready keys' values: each says whether its member trains
   in a round and which, :func:`ready_value`), nobody needs to leave a step: the decision is the first step boundary
   no member can have passed (:func:`switch_proposal`), and every member leaves at the start of that step
   (:func:`switches`). Any other round — a member lost (a step with it never completes), or one that already left
   its round (:data:`HELD`) — is :data:`AT_ONCE`;
6. **arrive** (each member, on the same store): it sets its :func:`arrival_key` and waits for every member's before
   it forms the round's default group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: the worker environment variable naming this node's round file (set by the agent in live mode)
ROUND_FILE_ENV = "ELASTICZERO_ROUND_FILE"
#: the prefix of the protocol's keys in the rendezvous store and the job's store (each round's: :func:`round_prefix`)
ROUND_PREFIX = "elasticzero/live/"
#: agree: the key prefix (in the new rendezvous round's store) under which each agent sets its last round number
LAST_ROUND_KEY = f"{ROUND_PREFIX}last_round/"
#: agree: what an agent that never handed out a round sets (a fresh joiner)
NO_ROUND = "none"


# -- the steps' keys and numbers (pure) ----------------------------------------------------------------------------
def last_round_key(group_rank: int) -> str:
    """agree: the key the agent of ``group_rank`` sets its last round number under."""
    return f"{LAST_ROUND_KEY}{group_rank}"


def last_round_value(last: int | None) -> str:
    """agree: what an agent sets (:data:`NO_ROUND` before its first round)."""
    return NO_ROUND if last is None else str(last)


def parse_last(raw: bytes) -> int | None:
    """agree: an agent's published last round (:data:`NO_ROUND`: none)."""
    text = raw.decode(errors="replace")
    return None if text == NO_ROUND else int(text)


def next_round_number(lasts: Sequence[int | None]) -> int:
    """agree: the round every agent takes — one above the highest round any of them handed out (0 for the first)."""
    known = [n for n in lasts if n is not None]
    return max(known) + 1 if known else 0


def round_prefix(number: int) -> str:
    """write: the store prefix of round ``number`` (unique per round within the job's store)."""
    return f"{ROUND_PREFIX}{number}/"


def ready_key(rank: int) -> str:
    """ready: the key a member sets under the round's prefix once it can switch to the round."""
    return f"ready/{rank}"


#: ready: what a fresh process (no round settled in it: a joiner's worker) sets under its :func:`ready_key`
NEW_MEMBER = "new"
#: ready: what a process sets once it left the round it trained in (it holds that round's state, trains in none)
HELD = "held"
#: switch: the decision of a round that is not a join: every member leaves the old round at once
AT_ONCE = -1
#: switch: the key (under the new round's prefix) of the step the old round's members switch at
SWITCH_KEY = "switch_at"


def ready_value(settled: tuple[int, int] | None, *, holds: bool = False) -> str:
    """ready: what a member sets under its :func:`ready_key`: ``"NUMBER:RANK"`` — the round it trains in and its rank
    there —, :data:`HELD` when it trains in none and ``holds`` state (it left its round), :data:`NEW_MEMBER` when it
    has neither."""
    if settled is not None:
        return f"{settled[0]}:{settled[1]}"
    return HELD if holds else NEW_MEMBER


def joins_only(values: Sequence[str], number: int, world_size: int) -> bool:
    """switch: whether the ready keys' ``values`` (:func:`ready_value`, one per member of the new round) name every
    rank of round ``number`` (of ``world_size``) exactly once and nobody else but fresh processes — a join, or the same
    members again: the old round's steps can still complete, so the switch can wait for a step boundary."""
    old = sorted(v for v in values if v != NEW_MEMBER)
    return old == sorted(ready_value((number, r)) for r in range(world_size))


def state_follows(values: Sequence[str]) -> bool:
    """Whether a round's ready keys' ``values`` (:func:`ready_value`, all set) name a member that holds state (it
    trains in a round of the job, or left one): the round's reshard writes it into every member's model — parameters,
    frozen parameters, persistent buffers —, so the round's build need not make the models alike first (nobody holds
    any only in the job's first round, or a restart's)."""
    return any(v != NEW_MEMBER for v in values)


def switch_decision(values: Sequence[str], number: int, world_size: int, proposal: int) -> int:
    """switch: what the first member to find every ready key set decides for the members of round ``number``:
    ``proposal`` (its :func:`switch_proposal`) where the ``values`` are a join (:func:`joins_only`), else
    :data:`AT_ONCE`."""
    return proposal if joins_only(values, number, world_size) else AT_ONCE


def switch_proposal(where: str, step: int, world_size: int, end: int | None = None) -> int:
    """switch: the step a member at ``step`` (its step in flight) of a round of ``world_size`` proposes to switch at —
    the first boundary no member can have passed, so no member leaves a step it began (members are at most one step
    apart: a step's host waits on a collective every member takes part in — the copies' commit gate, the loss's
    reduction). ``where`` it is: ``"idle"`` between two steps (a hold, a bounded wait outside a step) — ``step``, at
    once: a member held between steps holds the others too; ``"enter"``, its attempt's check before anything of
    ``step`` ran — the next one (a peer may be inside ``step``); ``"step"``, inside it — two on (a peer may have begun
    the next), one alone. Never past ``end - 1`` (the job's last step: the old members would end without the joiner)
    — so a member inside the last step leaves it at once, as every switch did before this step existed (a peer past
    its commit gate counts it done in the reshard)."""
    ahead = {"idle": 0, "enter": 1, "step": 1 if world_size == 1 else 2}[where]
    at = step + ahead
    return at if end is None else min(at, end - 1)


def switches(step: int, switch_at: int) -> bool:
    """switch: whether a member with ``step`` in flight (or next) leaves for the new round: at ``switch_at`` or past
    it (a member inside ``switch_at`` when it learns it leaves that step at once; :data:`AT_ONCE`: anywhere)."""
    return step >= switch_at


def arrival_key(rank: int) -> str:
    """arrive: the key a member sets under the round's prefix once it can form the group."""
    return f"arrived/{rank}"


# -- the file (schema, pure decision, thin I/O) -----------------------------------------------------------------------


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
