"""The prompt re-formation's decision (``agent/prompt.py``): when a participant that torch's join op tells to wait
out the last call may complete the round at once — every case, over torch's own state object."""

from __future__ import annotations

import itertools
from datetime import datetime, timezone

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elasticzero.agent.prompt import complete_now

A, B, C = (_NodeDesc("host", pid, 0) for pid in (1, 2, 3))
NOW = datetime.now(timezone.utc)


def state(participants: tuple[_NodeDesc, ...] = (A, B), **fields: object) -> _RendezvousState:
    """A forming re-formation (round 2, last call running) with ``participants``, all heartbeating."""
    s = _RendezvousState()
    s.round, s.deadline = 2, NOW
    s.participants = dict.fromkeys(participants, 0)
    s.last_heartbeats = dict.fromkeys(participants, NOW)
    for name, value in fields.items():
        setattr(s, name, value)
    return s


EXPECTED = frozenset({repr(A), repr(B)})


def test_a_re_formation_whose_participants_are_everyone_expected_and_known_completes_now() -> None:
    assert complete_now(state(), A, 1, 3, EXPECTED)
    assert complete_now(state(), A, 1, 3, frozenset({repr(A)}))  # the state knows B too, and B is in


def test_without_an_expectation_torchs_last_call_stands() -> None:
    assert not complete_now(state(), A, 1, 3, None)


def test_an_expected_node_not_in_yet_is_waited_for() -> None:
    """B left the old round (torch's exit op dropped its heartbeat) and has not joined yet: the state alone shows
    only A, the expectation still names B."""
    assert not complete_now(state((A,)), A, 1, 3, EXPECTED)


@pytest.mark.parametrize(
    "why, s, node",
    [
        ("already complete", state(complete=True), A),
        ("closed", state(closed=True), A),
        ("not a participant", state(), C),
        ("no last call running", state(deadline=None), A),
        ("another node heartbeats: it is coming", state(last_heartbeats={A: NOW, B: NOW, C: NOW}), A),
        ("a node waits for the next round", state(wait_list={C}), A),
        ("a node is redundant", state(redundancy_list={C}), A),
    ],
)
def test_it_waits_when(why: str, s: _RendezvousState, node: _NodeDesc) -> None:
    assert not complete_now(s, node, 1, 3, EXPECTED), why


def test_the_participants_must_be_a_valid_world() -> None:
    assert not complete_now(state(), A, 3, 3, EXPECTED)  # below min_nodes
    assert not complete_now(state((A, B, C)), A, 1, 2, EXPECTED)  # above max_nodes (torch would refuse the round)


def test_exactly_the_full_conjunction_completes() -> None:
    """Every combination of the conditions: only all of them true completes."""
    expectations = (None, frozenset({repr(A), repr(C)}), EXPECTED)
    flips = {
        "complete": (True, False), "closed": (True, False), "deadline": (None, NOW),
        "last_heartbeats": ({A: NOW, B: NOW, C: NOW}, {A: NOW, B: NOW}), "wait_list": ({C}, set()),
        "redundancy_list": ({C}, set()),
    }  # fmt: skip
    for picks in itertools.product((0, 1), repeat=len(flips) + 1):
        s = state(**{k: v[p] for (k, v), p in zip(flips.items(), picks, strict=False)})
        node = (C, A)[picks[-1]]
        for i, expected in enumerate(expectations):
            assert complete_now(s, node, 1, 3, expected) == (all(picks) and i == 2), (picks, expected)
