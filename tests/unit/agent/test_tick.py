"""The agent's monitor tick as a decision (``agent/tick.py``): a table of facts → the one action, and every
combination of the facts checked against the rules' order (a failure's rule, the stops, the membership changes, the
hang, nothing) — with a failed collective's ask in live mode."""

from __future__ import annotations

import itertools

import pytest

from elasticzero.agent.liveness import Liveness, dropped_line, gone_line, gone_reason, peer_plan, store_lost_line
from elasticzero.agent.progress import Hang
from elasticzero.agent.suspicion import Asked, answered_reason, asked_reason, silent_reason
from elasticzero.agent.tick import (
    MEMBERSHIP_RESTART,
    NODES_WAITING,
    STOPPED_HERE,
    Action,
    AskPeers,
    Change,
    Continue,
    Facts,
    Halt,
    HandOff,
    KillHung,
    Reform,
    Rejoin,
    ReportFailure,
    RoundView,
    Stop,
    Suspicion,
    Workers,
    change_of,
    decide,
    rejoin_line,
)

PLAN = peer_plan("4", {}, torch_defaults=False, store_in_agent="10.0.0.1:29400")
GONE = ("10.0.0.2_77_0",)
CHANGING = "node 1: restarting its workers for nodes waiting to join"
LEAVING = "node 2: leaving on SIGTERM"
FAILED = "node 0: root cause: rank 0 exit code 3"
HANG = Hang(rank=1, local_rank=1, pid=4242, step=7, idle_s=31.0, timeout_s=30.0, where="step", stopped=False)
ALIVE, LOST, DROPPED, SILENT = Liveness(), Liveness(gone=GONE), Liveness(self_gone=True), Liveness(store_silent_s=4.5)
REFORMED = "; re-forming the round, no restart spent"
# a failed collective's ask (agent/suspicion.py): this node A, peers B and C
A, B, C = "10.0.0.1_10_0", "10.0.0.2_20_0", "10.0.0.3_30_0"
NODES = frozenset({A, B, C})


def ask(asker: str | None = None, asked: Asked | None = None, reported: bool = True) -> Suspicion:
    return Suspicion(reported, asker, A, NODES, asked, 0.5)


REPORTED, ASKED_BY_B = ask(), ask(B)
PENDING = ask(A, Asked(frozenset({B}), 0.3))  # C has not answered yet, the timeout is not up
C_SILENT = ask(A, Asked(frozenset({B}), 0.5))  # C did not answer within the timeout: dropped
ALL_ANSWERED = ask(A, Asked(frozenset({B, C}), 0.1))  # every node answered: nobody dropped, whatever the time
CRASHED = HandOff(Change.PEER_CRASHED, silent_reason((C,), 0.5), silent_reason((C,), 0.5), drop=(C,))
CLOSED = "the rendezvous was closed by another node; stopping this node's workers"


def healthy(**kw: object) -> Facts:
    return Facts(Workers.HEALTHY, peers=PLAN, **kw)  # type: ignore[arg-type]


# -- the table ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("facts", "action"),
    [
        # torch says the workers failed: a round being changed re-joins for free, whatever the restarts left
        (Facts(Workers.FAILED, marks=RoundView(changing=CHANGING)), Rejoin(CHANGING)),
        (Facts(Workers.FAILED, True, 3, RoundView(changing=CHANGING)), Rejoin(CHANGING)),
        # a real failure: torch's loop spends a restart, or gives up
        (Facts(Workers.FAILED, remaining_restarts=2), ReportFailure(restart=True)),
        (Facts(Workers.FAILED, remaining_restarts=1), ReportFailure(restart=True)),
        (Facts(Workers.FAILED, remaining_restarts=0), ReportFailure(restart=False)),
        # a job marked failed is no membership change, even in a marked round
        (Facts(Workers.FAILED, False, 0, RoundView(CHANGING, FAILED)), ReportFailure(restart=False)),
        (Facts(Workers.FAILED, True, 1, RoundView(CHANGING, FAILED)), ReportFailure(restart=True)),
        # succeeded (or a state torch's loop handles alone): nothing of ours
        (Facts(Workers.OTHER, True, 1, RoundView(CHANGING, FAILED), True, LOST, True, HANG), Continue()),
        # healthy, nothing found
        (healthy(), Continue()),
        (healthy(live=True, remaining_restarts=3), Continue()),
        # the stops: a silent store host, a job marked failed, a closed rendezvous
        (healthy(liveness=SILENT), Stop(Halt.STORE_LOST, store_lost_line(PLAN, 4.5))),
        (
            healthy(marks=RoundView(job_failed=FAILED)),
            Stop(Halt.JOB_FAILED, f"the rendezvous was closed by another node, whose workers failed: {FAILED}"),
        ),
        (healthy(closed=True), Stop(Halt.CLOSED, CLOSED)),
        # a peer lost: marked; handed off in live mode, re-formed otherwise
        (healthy(liveness=LOST, live=True), HandOff(Change.PEER_LOST, gone_line(GONE, PLAN), gone_reason(GONE, PLAN))),
        (healthy(liveness=LOST), Reform(Change.PEER_LOST, gone_line(GONE, PLAN), gone_line(GONE, PLAN) + REFORMED)),
        # a peer lost in a round it marked itself (it left on a signal; its heartbeats stopped before this node's
        # workers died of its stop): its change, joined without marking over it — re-joined, or handed off in live mode
        (
            healthy(liveness=LOST, marks=RoundView(changing=LEAVING)),
            Reform(Change.PEER_LOST, None, f"{gone_reason(GONE, PLAN)}; {rejoin_line(LEAVING, STOPPED_HERE)}"),
        ),
        (
            healthy(liveness=LOST, marks=RoundView(changing=LEAVING), live=True),
            HandOff(Change.PEER_LOST, None, gone_reason(GONE, PLAN)),
        ),
        (
            healthy(liveness=LOST, marks=RoundView(LEAVING, FAILED)),
            Stop(Halt.JOB_FAILED, f"the rendezvous was closed by another node, whose workers failed: {FAILED}"),
        ),
        # this node dropped: its workers are stale, re-formed in either mode, and not marked
        (healthy(liveness=DROPPED, live=True), Reform(Change.NODE_DROPPED, None, dropped_line(PLAN) + REFORMED)),
        (healthy(liveness=DROPPED), Reform(Change.NODE_DROPPED, None, dropped_line(PLAN) + REFORMED)),
        # nodes waiting to join (torch's restart hook): marked; handed off in live mode
        (healthy(nodes_waiting=True, live=True), HandOff(Change.PEER_WAITING, MEMBERSHIP_RESTART, NODES_WAITING)),
        (
            Facts(Workers.HEALTHY, nodes_waiting=True),  # no peer watch needed
            Reform(Change.PEER_WAITING, MEMBERSHIP_RESTART, f"{MEMBERSHIP_RESTART}; no restart spent"),
        ),
        # a failed collective (live mode): ask; asked by another node: answer and hand off; this node's ask: wait for
        # the verdict, then hand off dropping the silent node, or with everyone when all answered
        (healthy(live=True, suspicion=REPORTED), AskPeers()),
        (healthy(suspicion=REPORTED), Continue()),  # no live mode, no ask (its workers report none anyway)
        # another node marked the round as changing: its hand-off closed the old group's connections, no ask (its
        # change comes: nodes waiting to join)
        (healthy(live=True, suspicion=REPORTED, marks=RoundView(changing=CHANGING)), Continue()),
        (
            healthy(live=True, suspicion=REPORTED, marks=RoundView(changing=CHANGING), nodes_waiting=True),
            HandOff(Change.PEER_WAITING, MEMBERSHIP_RESTART, NODES_WAITING),
        ),
        # but an ask already made is answered, marked round or not (the asker marks it before it hands off)
        (
            healthy(live=True, suspicion=ASKED_BY_B, marks=RoundView(changing=CHANGING)),
            HandOff(Change.PEER_ASKED, None, asked_reason(B), answer=True),
        ),
        (healthy(live=True, suspicion=ASKED_BY_B), HandOff(Change.PEER_ASKED, None, asked_reason(B), answer=True)),
        (
            healthy(live=True, suspicion=ask(B, reported=False)),
            HandOff(Change.PEER_ASKED, None, asked_reason(B), answer=True),
        ),
        (healthy(live=True, suspicion=PENDING), Continue()),
        (healthy(live=True, suspicion=ask(A)), Continue()),  # asked, no read of the answers yet
        (healthy(live=True, suspicion=C_SILENT), CRASHED),
        (
            healthy(live=True, suspicion=ALL_ANSWERED),
            HandOff(Change.CONNECTION_LOST, answered_reason(), answered_reason()),
        ),
        # the heartbeats' verdict first; an ask before nodes waiting to join and a hang
        (
            healthy(live=True, liveness=LOST, suspicion=C_SILENT),
            HandOff(Change.PEER_LOST, gone_line(GONE, PLAN), gone_reason(GONE, PLAN)),
        ),
        (
            healthy(live=True, liveness=DROPPED, suspicion=ASKED_BY_B),
            Reform(Change.NODE_DROPPED, None, dropped_line(PLAN) + REFORMED),
        ),
        (healthy(live=True, nodes_waiting=True, suspicion=REPORTED), AskPeers()),
        (healthy(live=True, hang=HANG, suspicion=PENDING), Continue()),
        (healthy(live=True, closed=True, suspicion=C_SILENT), Stop(Halt.CLOSED, CLOSED)),
        # a hung worker
        (healthy(hang=HANG), KillHung(HANG)),
        (healthy(hang=HANG, live=True), KillHung(HANG)),
        # precedence: a stop over a change, a change over a hang, dropped over lost, lost over waiting
        (healthy(liveness=SILENT, closed=True, hang=HANG), Stop(Halt.STORE_LOST, store_lost_line(PLAN, 4.5))),
        (healthy(liveness=LOST, closed=True, live=True), Stop(Halt.CLOSED, CLOSED)),
        (
            healthy(liveness=LOST, hang=HANG),
            Reform(Change.PEER_LOST, gone_line(GONE, PLAN), gone_line(GONE, PLAN) + REFORMED),
        ),
        (
            healthy(liveness=DROPPED, nodes_waiting=True, live=True),
            Reform(Change.NODE_DROPPED, None, dropped_line(PLAN) + REFORMED),
        ),
        (
            healthy(liveness=LOST, nodes_waiting=True, live=True),
            HandOff(Change.PEER_LOST, gone_line(GONE, PLAN), gone_reason(GONE, PLAN)),
        ),
    ],
)
def test_decide(facts: Facts, action: Action) -> None:
    assert decide(facts) == action


# -- every combination against the rules' order ------------------------------------------------------------------
LIVENESS = {"alive": ALIVE, "lost": LOST, "dropped": DROPPED, "silent": SILENT}
MARKS = [RoundView(), RoundView(changing=CHANGING), RoundView(job_failed=FAILED), RoundView(CHANGING, FAILED)]
SUSPICIONS = [Suspicion(), REPORTED, ASKED_BY_B, PENDING, C_SILENT, ALL_ANSWERED]
EVERY = [
    Facts(workers, live, remaining, marks, waiting, liveness, closed, hang, PLAN, suspicion)
    for workers, live, remaining, marks, waiting, liveness, closed, hang, suspicion in itertools.product(
        Workers, (False, True), (0, 1), MARKS, (False, True), LIVENESS.values(), (False, True), (None, HANG), SUSPICIONS
    )
]


def test_the_table_spans_every_combination() -> None:
    assert len(EVERY) == 3 * 2 * 2 * 4 * 2 * 4 * 2 * 2 * 6 and len(set(EVERY)) == len(EVERY)


def test_failed_and_finished_workers_read_only_the_marks_and_the_restarts() -> None:
    for facts in (f for f in EVERY if f.workers is not Workers.HEALTHY):
        if facts.workers is Workers.OTHER:
            expected: Action = Continue()
        elif facts.marks.changing is not None and facts.marks.job_failed is None:
            expected = Rejoin(CHANGING)
        else:
            expected = ReportFailure(restart=facts.remaining_restarts > 0)
        assert decide(facts) == expected, facts


def _asking(f: Facts) -> type | None:
    """What a live node's ask leads to (None: no ask in the round, nothing reported)."""
    s = f.suspicion
    if s.asker is None:
        return AskPeers if s.reported and f.marks.changing is None else None
    return Continue if s is PENDING else HandOff


def _expected_kind(f: Facts) -> type:
    """The rules' order, written as a list: the first that applies."""
    asking = _asking(f) if f.live else None
    rules: list[tuple[bool, type]] = [
        (f.liveness.store_silent_s is not None, Stop),
        (f.marks.job_failed is not None or f.closed, Stop),
        (f.liveness.self_gone, Reform),
        (bool(f.liveness.gone), HandOff if f.live else Reform),
        (asking is not None, asking or Continue),
        (f.nodes_waiting, HandOff if f.live else Reform),
        (f.hang is not None, KillHung),
    ]
    return next((kind for applies, kind in rules if applies), Continue)


ASK_CHANGES = {
    id(ASKED_BY_B): Change.PEER_ASKED,
    id(C_SILENT): Change.PEER_CRASHED,
    id(ALL_ANSWERED): Change.CONNECTION_LOST,
}


def _expected_change(f: Facts) -> Change | None:
    """The heartbeats' change wins; then the ask's; then nodes waiting."""
    change = change_of(f)
    if change in (Change.NODE_DROPPED, Change.PEER_LOST) or not f.live:
        return change
    return ASK_CHANGES.get(id(f.suspicion), change)


def test_healthy_ticks_follow_the_rules_order() -> None:
    for facts in (f for f in EVERY if f.workers is Workers.HEALTHY):
        action = decide(facts)
        assert type(action) is _expected_kind(facts), facts
        if isinstance(action, Stop):
            silent, failed = facts.liveness.store_silent_s is not None, facts.marks.job_failed is not None
            assert action.halt is (Halt.STORE_LOST if silent else Halt.JOB_FAILED if failed else Halt.CLOSED), facts
        if isinstance(action, HandOff | Reform):
            change = _expected_change(facts)
            assert action.change is change, facts
            # a dropped node's store is stale; a lost peer's change already marked is not marked over; an asked node
            # joins the asker's change
            joined = change is Change.PEER_LOST and facts.marks.changing is not None
            unmarked = change in (Change.NODE_DROPPED, Change.PEER_ASKED) or joined
            assert (action.mark is None) is unmarked, facts
            if isinstance(action, HandOff):
                assert (action.drop == (C,)) is (change is Change.PEER_CRASHED), facts
                assert action.answer is (change is Change.PEER_ASKED), facts
        if isinstance(action, Reform):
            assert "no restart spent" in action.line, facts
            assert (f"round is changing ({CHANGING}); re-joining" in action.line) is joined, facts


def test_the_store_lost_line_needs_the_peer_plan() -> None:
    with pytest.raises(ValueError, match="without the peer plan"):
        decide(Facts(Workers.HEALTHY, liveness=SILENT))
