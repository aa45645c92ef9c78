"""One monitor tick of the agent, as a decision: the facts the tick gathered in, one action out (pure, no I/O).

torch's ``dynamic_rendezvous.py`` shape (``_RendezvousJoinOp`` returns an action over a state snapshot): the
overrides of :class:`~elasticzero.agent.agent.ElasticZeroAgent` that torch's run loop calls each tick gather what
they read into one frozen :class:`Facts` — torch's verdict on the workers, the round's marks in the rendezvous store,
the peer-liveness verdict (:mod:`~elasticzero.agent.liveness`), whether the rendezvous is closed, the hang verdict
(:mod:`~elasticzero.agent.progress`), whether torch's loop found nodes waiting to join, the state of an ask after a
failed collective (:mod:`~elasticzero.agent.suspicion`) — call :func:`decide`, and carry out the one :data:`Action` it
returns. A membership change names its kind (:class:`Change`): a peer lost, a peer waiting to join, this node
dropped, a peer crashed, a connection lost with every node alive, another node's ask.

The rules (docs/agent.md, "Membership changes are not failures", "Peer liveness", "Live recovery"):

* failed workers in a round another node marked as changing re-join for free (:class:`Rejoin`); otherwise a real
  failure: its root cause is reported and torch's loop spends a restart, or gives up (:class:`ReportFailure`);
* healthy workers: a silent store host (c10d) ends the agent, then a job marked failed or a rendezvous closed by
  another node (:class:`Stop`); then a membership change: with ``--live-recovery`` the running workers are handed
  the new round (:class:`HandOff`) unless this node itself was dropped — its workers are stale — else they are
  stopped and the round re-formed (:class:`Reform`); neither spends a restart, and a change the other nodes must
  hear of is marked first (``mark``) — except a peer lost in a round another node already marked (a node leaving on a
  signal whose heartbeats stop before this node's workers die of its stop): that node's change, joined without a
  mark of this node's over it; then a hung worker is stopped (:class:`KillHung`: it fails the next tick).
* in live mode, between a peer found gone by its heartbeat and nodes waiting to join: a failed collective's ask
  (:mod:`~elasticzero.agent.suspicion`). A local worker reported one, nobody asked yet and no node marked the round as
  changing (a peer handing its workers a new round closes the old group's connections): ask (:class:`AskPeers`);
  another node asked: answer and hand off at once; this node asked: wait for the verdict, then hand off — dropping
  the silent nodes from the rendezvous first (``drop``), or with everyone when all answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from elasticzero.agent.liveness import Liveness, PeerPlan, dropped_line, gone_line, gone_reason, store_lost_line
from elasticzero.agent.progress import Hang
from elasticzero.agent.suspicion import (
    AllAnswered,
    Asked,
    Silent,
    answered_reason,
    ask_verdict,
    asked_reason,
    silent_reason,
)

#: why a node with healthy workers changes the round when torch's loop saw nodes waiting to join; logged and marked
MEMBERSHIP_RESTART = "restarting its workers for nodes waiting to join"
#: the cause of a join, in a hand-off's line
NODES_WAITING = "nodes are waiting to join"
#: the cause in a re-join line when this node stops its own healthy workers to join a marked round's change
STOPPED_HERE = "this node stopped its workers"


class Change(Enum):
    """The kind of membership change a tick found."""

    PEER_LOST = "peer lost"  #: a participant of the round went silent past the peer timeout, or left the state
    PEER_WAITING = "peer waiting to join"  #: torch's loop found nodes waiting to join (its restart hook)
    NODE_DROPPED = "this node dropped"  #: this node was silent past the timeout (frozen, cut off): the others went on
    PEER_CRASHED = "peer crashed"  #: a collective failed and a participant did not answer the ask: dropped
    CONNECTION_LOST = "connection lost"  #: a collective failed but every participant answered: re-formed with all
    PEER_ASKED = "asked by a peer"  #: another node's collective failed and it asked this node: the round re-forms


class Workers(Enum):
    """torch's verdict on this node's workers, as the tick sees it."""

    HEALTHY = "healthy"
    FAILED = "failed"  #: failed or unhealthy, with failures to report
    OTHER = "other"  #: succeeded, or a state torch's loop handles alone


class Halt(Enum):
    """Why a healthy node stops (one exception each, raised by the agent)."""

    STORE_LOST = "store lost"  #: the c10d store's host has not answered for the peer timeout
    JOB_FAILED = "job failed"  #: another node gave up (restarts exhausted) and marked the job failed
    CLOSED = "closed"  #: another node closed the rendezvous


@dataclass(frozen=True)
class RoundView:
    """The current round's marks in the rendezvous store."""

    changing: str | None = None  #: the round-change mark's value: another node is changing the round or leaving
    job_failed: str | None = None  #: the job-failed mark's value: a node gave up, the job is over


@dataclass(frozen=True)
class Suspicion:
    """A failed collective's ask in the current rendezvous round (:mod:`~elasticzero.agent.suspicion`)."""

    reported: bool = False  #: a local worker's collective failed on a lost peer's error in the current live round
    asker: str | None = None  #: the node that asked (the ask key's value); None: nobody asked
    this_node: str = ""
    round_nodes: frozenset[str] = frozenset()  #: the round's participants
    asked: Asked | None = None  #: this node's ask as its peer read saw it (the asker only)
    timeout_s: float = 0.0  #: how long an ask waits for answers


@dataclass(frozen=True)
class Facts:
    """What one tick (or torch's restart hook) read, as plain values."""

    workers: Workers
    live: bool = False  #: ``--live-recovery``
    remaining_restarts: int = 0
    #: read after a failure; on a healthy tick, the job-failed mark where it was read, the change mark if a peer is lost
    marks: RoundView = RoundView()
    nodes_waiting: bool = False  #: torch's loop is restarting healthy workers: nodes wait to join
    liveness: Liveness = field(default_factory=Liveness)  #: the peer-liveness verdict (alive without a peer watch)
    closed: bool = False  #: the rendezvous is closed (another node gave up, or the job finished)
    hang: Hang | None = None  #: a hung local worker
    peers: PeerPlan | None = None  #: the peer timeout the liveness verdict used (for the lines)
    suspicion: Suspicion = Suspicion()  #: live mode: a failed collective's ask


@dataclass(frozen=True)
class Continue:
    """Nothing to do: torch's verdict stands."""


@dataclass(frozen=True)
class ReportFailure:
    """A real failure: report its root cause; torch's loop spends a restart (``restart``) or gives up."""

    restart: bool


@dataclass(frozen=True)
class Rejoin:
    """The workers failed while the round changes: stop, re-rendezvous, start; no restart spent."""

    why: str  #: the round-change mark's value


@dataclass(frozen=True)
class HandOff:
    """Keep the workers running: mark the round (``mark``), re-rendezvous, write them the new round; no restart."""

    change: Change
    mark: str | None  #: the round-change mark to set first (None: none)
    why: str  #: the cause, in the hand-off's line
    drop: tuple[str, ...] = ()  #: nodes to drop from the rendezvous first (their heartbeats expired): a crash
    answer: bool = False  #: answer another node's ask first


@dataclass(frozen=True)
class Reform:
    """Stop the workers, re-rendezvous, start fresh ones; no restart spent. ``mark`` first, then ``line``."""

    change: Change
    mark: str | None
    line: str  #: the stderr line


@dataclass(frozen=True)
class Stop:
    """This node stops: :class:`Halt` says which error, ``line`` what it says."""

    halt: Halt
    line: str


@dataclass(frozen=True)
class KillHung:
    """Stop a hung worker (stacks first): torch's loop sees it fail next tick, a real failure."""

    hang: Hang


@dataclass(frozen=True)
class AskPeers:
    """A local worker's collective failed on a lost peer's error: ask the round's nodes whether they are alive."""


Action = Continue | ReportFailure | Rejoin | HandOff | Reform | Stop | KillHung | AskPeers


def decide(facts: Facts) -> Action:
    """The one action for ``facts`` (see the module docstring for the rules and their order)."""
    if facts.workers is Workers.FAILED:
        return _failed(facts)
    if facts.workers is not Workers.HEALTHY:
        return Continue()
    stop = _stop(facts)
    if stop is not None:
        return stop
    change = change_of(facts)
    if change in (Change.NODE_DROPPED, Change.PEER_LOST):
        return _change(change, facts)  # the heartbeats decided already
    asking = _suspected(facts) if facts.live else None
    if asking is not None:
        return asking
    if change is not None:
        return _change(change, facts)
    return KillHung(facts.hang) if facts.hang is not None else Continue()


def _suspected(facts: Facts) -> Action | None:
    """A failed collective's ask (see the module): ask, answer, wait for the verdict, or hand off on it."""
    s = facts.suspicion
    if s.asker is None:  # a round another node marked as changing explains the failure: its change comes (no ask)
        return AskPeers() if s.reported and facts.marks.changing is None else None
    if s.asker != s.this_node:
        return HandOff(Change.PEER_ASKED, None, asked_reason(s.asker), answer=True)
    verdict = ask_verdict(s.round_nodes, s.this_node, s.asked, s.timeout_s) if s.asked is not None else None
    if isinstance(verdict, Silent):
        why = silent_reason(verdict.nodes, s.timeout_s)
        return HandOff(Change.PEER_CRASHED, why, why, drop=verdict.nodes)
    if isinstance(verdict, AllAnswered):
        return HandOff(Change.CONNECTION_LOST, answered_reason(), answered_reason())
    return Continue()  # waiting for the answers (a fraction of a second)


def _failed(facts: Facts) -> Action:
    """A node marks the round *before* it stops its workers for a membership change, and a peer's workers can only
    die of that stop afterwards; the store is linearizable, so by the time this node sees its workers dead the mark
    is there. Any failure seen in a round so marked counts as part of the change — unless the job is marked failed."""
    changing = facts.marks.changing
    if changing is not None and facts.marks.job_failed is None:
        return Rejoin(changing)
    return ReportFailure(restart=facts.remaining_restarts > 0)


def _stop(facts: Facts) -> Stop | None:
    """A silent store host first (no store call was made after it), then the job marked failed, then closed."""
    silent = facts.liveness.store_silent_s
    if silent is not None:
        return Stop(Halt.STORE_LOST, store_lost_line(_plan(facts), silent))
    if facts.marks.job_failed is not None:
        line = f"the rendezvous was closed by another node, whose workers failed: {facts.marks.job_failed}"
        return Stop(Halt.JOB_FAILED, line)
    if facts.closed:
        return Stop(Halt.CLOSED, "the rendezvous was closed by another node; stopping this node's workers")
    return None


def change_of(facts: Facts) -> Change | None:
    """The membership change a healthy tick found: this node dropped wins (its view of the others is stale)."""
    if facts.liveness.self_gone:
        return Change.NODE_DROPPED
    if facts.liveness.gone:
        return Change.PEER_LOST
    return Change.PEER_WAITING if facts.nodes_waiting else None


def _change(change: Change, facts: Facts) -> HandOff | Reform:
    """Hand off in live mode, unless this node was dropped: its workers are stale, they join the new round fresh."""
    if change is Change.NODE_DROPPED:
        return Reform(change, None, f"{dropped_line(_plan(facts))}; re-forming the round, no restart spent")
    if change is Change.PEER_WAITING:
        if facts.live:
            return HandOff(change, MEMBERSHIP_RESTART, NODES_WAITING)
        return Reform(change, MEMBERSHIP_RESTART, f"{MEMBERSHIP_RESTART}; no restart spent")
    gone, plan = facts.liveness.gone, _plan(facts)
    changing = facts.marks.changing
    if changing is not None:  # the node that marked the round (e.g. leaving on SIGTERM) announced this change
        return _join_marked(change, facts.live, gone_reason(gone, plan), changing)
    if facts.live:
        return HandOff(change, gone_line(gone, plan), gone_reason(gone, plan))
    return Reform(change, gone_line(gone, plan), f"{gone_line(gone, plan)}; re-forming the round, no restart spent")


def _join_marked(change: Change, live: bool, reason: str, changing: str) -> HandOff | Reform:
    """A peer lost in a round another node already marked as changing — a node leaving on a signal marks it before it
    stops its workers, and may stop its heartbeats before this node's workers die of that stop (a collective takes
    seconds to notice a dead peer). The same change: this node joins it without marking over the leaver's mark (a
    peer whose workers die next re-joins on it) — handed off in live mode, else its workers stopped and re-joined."""
    if live:
        return HandOff(change, None, reason)
    return Reform(change, None, f"{reason}; {rejoin_line(changing, STOPPED_HERE)}")


def rejoin_line(changing: str, cause: str) -> str:
    """The line of a node re-joining a round another node marked as changing (``cause``: why its workers stopped)."""
    return f"workers stopped while the round is changing ({changing}); re-joining, no restart spent ({cause})"


def _plan(facts: Facts) -> PeerPlan:
    """The peer plan behind a liveness verdict (a verdict other than alive comes from a peer watch, which has one)."""
    if facts.peers is None:
        raise ValueError("a peer-liveness verdict without the peer plan it was judged by")
    return facts.peers


def leaving_is_membership_change(group_world_size: int, min_nodes: int) -> bool:
    """A node leaving on a signal is a membership change only if the others can go on without it."""
    return group_world_size - 1 >= min_nodes
