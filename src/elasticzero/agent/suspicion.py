"""A crashed peer found by its symptom, confirmed by the store (pure decisions; the I/O is the agent's and the peer
watch's, :mod:`elasticzero.agent.peers`).

When a node dies (SIGKILL, a kernel panic, a power cut) its sockets close, and the survivors' collective of the step
fails at once (gloo: "Connection closed by peer"); waiting for its heartbeat to age past the peer timeout would cost
the whole timeout. A closed connection is evidence, not proof — a live node whose connection dropped must be kept — so
the agents ask before they drop anyone (docs/agent.md, "Live recovery"):

1. **report**: a live worker whose collective fails on a lost peer's error
   (:meth:`~elasticzero.live.bounded.BoundedWait.after_failure`) marks its progress record with the round it is in
   (:meth:`~elasticzero.progress.Reporter.peer_failed`); its agent's next tick sees it (:func:`reported`);
2. **ask**: that agent sets :data:`ASK_KEY` in the rendezvous round's store, first asker wins (``compare_set``);
3. **answer**: every other agent's peer read finds the ask; its next tick sets its :func:`answer_key` and joins the
   change at once (a hand-off: its workers' group is broken too);
4. **verdict** (:func:`ask_verdict`, over the asker's reads): every other participant answered — all alive, the
   round re-forms with everyone; the ask timeout (:func:`ask_timeout_s`) passed with some silent — they are dropped:
   their heartbeats in torch's rendezvous state are set to the epoch in one compare-and-set (:func:`expire`), so
   torch's own rule (``_sanitize``) removes them at the next read of the state, and the round re-forms without
   waiting for the peer timeout.

A node frozen rather than dead answers nothing either and is dropped the same way (it rejoins when it thaws, as after
a heartbeat timeout); a freeze that closes no socket is still found by the heartbeat alone. The keys live under the
rendezvous round's prefix: a new round starts with none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from elasticzero.progress import ProgressRecord

#: the ask, in the rendezvous round's store: its value is the asking node's descriptor
ASK_KEY = "elasticzero/agent/ask"
#: an ask waits for this many of the answering agents' monitor ticks: a live agent answers at its first tick after its
#: peer read found the ask, the rest is slack for a loaded machine. A live node that misses it is dropped and rejoins as
#: after a heartbeat timeout (a round change, no lost state) — the price of a crash found in a second
ASK_READS = 5
#: etcd agents read the state every :data:`~elasticzero.agent.peers.READ_PERIOD_S` only: this many of those at least
ETCD_ASK_READS = 2
#: and never less than this (s): at torch's 0.1 s monitor tick, 5 reads
ASK_TIMEOUT_S = 0.5
#: the heartbeat a dropped node gets: older than any peer timeout, so torch's ``_sanitize`` removes it
EPOCH = datetime.fromtimestamp(0, timezone.utc)


def answer_key(node: str) -> str:
    """Where ``node`` answers an ask (its descriptor, as the peer watch names nodes)."""
    return f"elasticzero/agent/alive/{node}"


def ask_timeout_s(monitor_interval_s: float, read_period_s: float | None) -> float:
    """How long an ask waits for answers: :data:`ASK_READS` monitor ticks, at least :data:`ETCD_ASK_READS` of the
    agents' state reads where they read less often than they tick (etcd: ``read_period_s``; c10d reads every tick,
    which the ticks already cover; None: no reads of their own), and never less than :data:`ASK_TIMEOUT_S` (the
    default 0.1 s tick: 0.5 s with c10d, 1 s with etcd)."""
    return max(ASK_TIMEOUT_S, ASK_READS * monitor_interval_s, ETCD_ASK_READS * (read_period_s or 0.0))


def reported(records: Iterable[ProgressRecord | None], round_number: int | None) -> bool:
    """Whether a local worker's collective failed on a lost peer's error in live round ``round_number`` (a failure
    left from an older round — a worker still waiting in the abandoned round — is no news)."""
    if round_number is None:
        return False
    return any(r is not None and r.failed_round == round_number + 1 for r in records)


@dataclass(frozen=True)
class Asked:
    """This node's ask in the current rendezvous round, as the last peer read saw it."""

    answered: frozenset[str]  #: the nodes whose answer keys were there
    elapsed_s: float  #: since the ask was set


@dataclass(frozen=True)
class AllAnswered:
    """Every other participant answered: nobody is dropped; the round re-forms (the connection is gone)."""


@dataclass(frozen=True)
class Silent:
    """These participants did not answer within the ask timeout: dropped."""

    nodes: tuple[str, ...]


Verdict = AllAnswered | Silent | None  #: None: still waiting


def ask_verdict(round_nodes: frozenset[str], this_node: str, asked: Asked, timeout_s: float) -> Verdict:
    """The asker's verdict: all answered, the silent ones once the timeout passed, else keep waiting."""
    missing = round_nodes - {this_node} - asked.answered
    if not missing:
        return AllAnswered()
    if asked.elapsed_s < timeout_s:
        return None
    return Silent(tuple(sorted(missing)))


def expire(state: Any, nodes: Iterable[str]) -> bool:
    """Set the heartbeat of every node of ``nodes`` (descriptors, as ``repr``) in torch's rendezvous ``state`` to the
    epoch; whether any was there (a node torch already removed needs nothing)."""
    names = set(nodes)
    found = [n for n in state.last_heartbeats if repr(n) in names]
    for node in found:
        state.last_heartbeats[node] = EPOCH
    return bool(found)


def may_drop(state: Any, this_node: str) -> bool:
    """Whether ``this_node`` may drop others from torch's rendezvous ``state``: it is still one of its participants."""
    return any(repr(n) == this_node for n in state.participants)


def silent_reason(nodes: tuple[str, ...], timeout_s: float) -> str:
    """Why the round changes after an unanswered ask (the hand-off's line)."""
    return (
        f"a collective failed on a lost peer's connection and peer node(s) {', '.join(nodes)} did not answer within "
        f"{timeout_s:g} s: dropped from the rendezvous"
    )


def answered_reason() -> str:
    """Why the round changes when every node answered."""
    return "a collective failed on a lost peer's connection but every node answered: re-forming with all of them"


def ask_line(round_nodes: frozenset[str]) -> str:
    """The asker's line."""
    return (
        f"a collective failed on a lost peer's connection: asking the round's {len(round_nodes) - 1} other node(s) "
        "whether they are alive"
    )


def asked_reason(asker: str) -> str:
    """Why a node that was asked joins the change."""
    return f"node {asker} asked whether this node is alive (a collective failed): answered, joining the new round"
