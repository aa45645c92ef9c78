"""A failed collective's ask (``agent/suspicion.py``), the pure rules: which report counts, the verdict over the
answers, the heartbeats a drop expires (on torch's own rendezvous state object, through torch's own rule)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elasticzero.agent.suspicion import (
    EPOCH,
    AllAnswered,
    Asked,
    Silent,
    ask_timeout_s,
    ask_verdict,
    expire,
    may_drop,
    reported,
)
from elasticzero.progress import ProgressRecord

A, B, C = "a_1_0", "b_2_0", "c_3_0"
NODES = frozenset({A, B, C})


def record(round_: int, failed_round: int) -> ProgressRecord:
    return ProgressRecord(1, 0, 0, 0, 0, 0, 1, 0, round_, failed_round)


def test_a_report_counts_only_in_the_round_the_agent_handed_out() -> None:
    """Stored + 1: round 4's failure is 5. A failure left from the abandoned round 3 is no news in round 4; none before
    the first round; a worker with no record reports nothing."""
    assert reported([record(5, 5)], 4)
    assert reported([None, record(5, 0), record(5, 5)], 4)
    assert not reported([record(4, 4)], 4)  # the worker still in round 3's wait
    assert not reported([record(5, 0), None], 4)
    assert not reported([record(1, 1)], None)


def test_the_verdict_waits_for_every_other_node_until_the_timeout() -> None:
    assert ask_verdict(NODES, A, Asked(frozenset(), 0.0), 0.5) is None
    assert ask_verdict(NODES, A, Asked(frozenset({B}), 0.49), 0.5) is None
    assert ask_verdict(NODES, A, Asked(frozenset({B}), 0.5), 0.5) == Silent((C,))
    assert ask_verdict(NODES, A, Asked(frozenset(), 9.0), 0.5) == Silent((B, C))


def test_all_answered_is_final_at_once_and_the_asker_need_not_answer_itself() -> None:
    assert ask_verdict(NODES, A, Asked(frozenset({B, C}), 0.0), 0.5) == AllAnswered()
    assert ask_verdict(frozenset({A}), A, Asked(frozenset(), 0.0), 0.5) == AllAnswered()


def test_the_ask_waits_five_of_the_answerers_reads_and_at_least_half_a_second() -> None:
    """c10d agents read every monitor tick, etcd agents every 0.5 s at the soonest."""
    assert ask_timeout_s(0.1, None) == 0.5  # torch's default tick
    assert ask_timeout_s(0.2, None) == 1.0  # the agent tests' tick
    assert ask_timeout_s(0.01, None) == 0.5  # never below the floor
    assert ask_timeout_s(0.1, 0.5) == 1.0 and ask_timeout_s(1.0, 0.5) == 5.0  # etcd: two of its 0.5 s reads, or ticks


def test_an_expired_heartbeat_is_one_torchs_rule_drops() -> None:
    """``expire`` sets the heartbeat to the epoch; torch's ``_sanitize`` rule (older than interval x attempts) then
    removes the node at any timeout; a node not in the state is reported as not found, the state untouched."""
    now = datetime.now(timezone.utc)
    state = _RendezvousState()
    a, b = _NodeDesc("a", 1, 0), _NodeDesc("b", 2, 0)
    state.participants = {a: 0, b: 1}
    state.last_heartbeats = {a: now, b: now}
    assert expire(state, [repr(b)])
    assert state.last_heartbeats == {a: now, b: EPOCH}
    assert EPOCH < now - timedelta(days=365)
    assert not expire(state, ["z_9_0"]) and state.last_heartbeats == {a: now, b: EPOCH}


def test_only_a_participant_drops_others() -> None:
    """A node dropped meanwhile (frozen, then resumed into its stale view of the round) drops nobody."""
    state = _RendezvousState()
    a, b = _NodeDesc("a", 1, 0), _NodeDesc("b", 2, 0)
    state.participants = {a: 0}
    assert may_drop(state, repr(a)) and not may_drop(state, repr(b))
