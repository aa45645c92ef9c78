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
