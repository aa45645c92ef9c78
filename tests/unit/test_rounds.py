"""The live-round protocol: the agreed round number and the steps' keys; the round file — parsing and the worker's
decision are pure (errors as data); the reader and the writer use a real file (the agent's side writes it, the
workers poll it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticzero.rounds import (
    AT_ONCE,
    LAST_ROUND_KEY,
    NO_ROUND,
    ROUND_PREFIX,
    NodeRound,
    RoundError,
    RoundFile,
    StoreAddress,
    arrival_key,
    decide_node,
    joins_only,
    last_round_key,
    last_round_value,
    next_round_number,
    parse_last,
    parse_node_round,
    ready_value,
    round_prefix,
    state_follows,
    switch_decision,
    switch_proposal,
    switches,
    write_round,
)

STORE = StoreAddress("10.0.0.1", 29400, False)


# -- agree, write, arrive: the numbers and keys -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lasts", "number"),
    [
        ([None], 0),  # the job's first round
        ([None, None, None], 0),
        ([3, 3], 4),  # survivors at round 3
        ([3, None], 4),  # a fresh joiner has none
        ([2, 5, 4], 6),  # a node dropped at 2 rejoins; the others went on to 5 (and one restarted at 4)
    ],
)
def test_next_round_number_is_above_every_round_handed_out(lasts: list[int | None], number: int) -> None:
    assert next_round_number(lasts) == number
    assert all(last is None or number > last for last in lasts)


def test_an_agents_last_round_round_trips_through_its_key() -> None:
    assert [last_round_key(r) for r in range(2)] == [f"{LAST_ROUND_KEY}0", f"{LAST_ROUND_KEY}1"]
    assert last_round_value(None) == NO_ROUND and parse_last(last_round_value(None).encode()) is None
    assert parse_last(last_round_value(7).encode()) == 7


def test_each_round_has_its_own_prefix_and_the_protocols_keys_share_one() -> None:
    prefixes = {round_prefix(n) for n in range(50)}
    assert len(prefixes) == 50 and all(p.startswith(ROUND_PREFIX) and p.endswith("/") for p in prefixes)
    assert LAST_ROUND_KEY.startswith(ROUND_PREFIX) and LAST_ROUND_KEY not in prefixes
    assert arrival_key(3) != arrival_key(4)  # set under a round's prefix, one per member


# -- the file -------------------------------------------------------------------------------------------------------
def raw(**doc: object) -> bytes:
    return json.dumps(doc).encode()


def good(**change: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "round": 2,
        "world_size": 3,
        "ranks": {"1": 2, "0": 0},
        "store": {"host": "10.0.0.1", "port": 29400, "rank0_hosts": False},
        "prefix": "r2/",
    }
    return {**doc, **change}


def test_a_round_round_trips_through_its_json() -> None:
    r = NodeRound(3, 4, ((0, 1), (1, 3)), StoreAddress("h", 1234, True), "round3/")
    assert parse_node_round(r.to_json().encode()) == r
    assert (r.rank_of(1), r.rank_of(2)) == (3, None)


def test_ranks_are_put_in_local_rank_order() -> None:
    assert parse_node_round(raw(**good())) == NodeRound(2, 3, ((0, 0), (1, 2)), STORE, "r2/")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"ranks": [0, 1]}, "not a round"),
        ({"store": {"host": "h"}}, "not a round"),
        ({"round": -1}, "not a round number"),
        ({"world_size": 0}, "not a round number"),
        ({"ranks": {"0": 3}}, "not distinct ranks below 3"),
        ({"ranks": {"0": 1, "1": 1}}, "not distinct ranks below 3"),
        ({"prefix": ""}, "no store prefix"),
        ({"store": {"host": "h", "port": 0, "rank0_hosts": False}}, "bad store port"),
    ],
)
def test_what_is_not_a_round_is_an_error_naming_the_file(change: dict[str, object], says: str) -> None:
    found = parse_node_round(raw(**good(**change)), "/run/ez/round.json")
    assert isinstance(found, RoundError) and "/run/ez/round.json" in found.reason and says in found.reason


def test_a_worker_acts_only_on_a_newer_round() -> None:
    r = raw(**good())
    assert decide_node(None, 0) is None
    assert decide_node(r, 2) is None and decide_node(r, 3) is None
    assert decide_node(r, 1) == parse_node_round(r)
    assert isinstance(decide_node(b"{", 5), RoundError)  # a broken file is reported whatever the round


def test_the_file_reads_what_the_agent_writes(tmp_path: Path) -> None:
    path = str(tmp_path / "round.json")
    source = RoundFile(path)
    assert source.read() is None and source.poll(-1) is None  # not there yet: nothing, never an exception
    first = NodeRound(0, 2, ((0, 0),), STORE, "r0/")
    write_round(path, first)
    assert source.poll(-1) == first and source.poll(0) is None
    write_round(path, NodeRound(1, 1, ((0, 0),), STORE, "r1/"))
    assert source.poll(0) == NodeRound(1, 1, ((0, 0),), STORE, "r1/")
    assert [p.name for p in tmp_path.iterdir()] == ["round.json"]  # written whole, renamed into place


# -- ready, switch: a join waits for a step boundary -----------------------------------------------------------------
def test_a_join_is_every_old_member_and_fresh_processes_only() -> None:
    old = [ready_value((4, r)) for r in range(3)]
    assert old == ["4:0", "4:1", "4:2"] and ready_value(None) == "new"
    assert joins_only(["new", *old], 4, 3) and joins_only(old[::-1], 4, 3)  # a join; the same members again
    assert not joins_only(["new", *old[:2]], 4, 3)  # old rank 2 lost, a fresh process in its place
    assert not joins_only(["3:2", *old[:2]], 4, 3)  # a process of another round (an entry left for this one)
    assert not joins_only([*old, "4:2"], 4, 3) and not joins_only(old, 4, 2)


def test_state_follows_where_a_member_trains_in_a_round_of_the_job() -> None:
    assert state_follows(["new", "4:1"]) and state_follows(["3:0"])  # a survivor holds state: the reshard writes all
    assert state_follows(["new", "held"])  # one that left its round holds it too
    assert not state_follows(["new", "new"])  # the job's first round, or a restart's: the build makes them alike


def test_a_member_that_left_its_round_is_no_member_of_it_and_a_non_join_switches_at_once() -> None:
    assert ready_value((4, 1), holds=True) == "4:1" and ready_value(None, holds=True) == "held"
    assert switch_decision(["4:0", "new", "4:1"], 4, 2, 9) == 9  # a join: the proposal
    assert switch_decision(["4:0", "held"], 4, 2, 9) == AT_ONCE == -1  # a member left round 4 already
    assert switch_decision(["4:0", "new"], 4, 2, 9) == AT_ONCE  # old rank 1 lost


@pytest.mark.parametrize(
    ("where", "world", "end", "at"),
    [
        ("idle", 2, None, 7),  # between steps, waiting: at once (a held member holds everyone)
        ("enter", 2, None, 8),  # entering step 7: a peer may be inside it
        ("step", 2, None, 9),  # inside step 7: a peer may have begun step 8
        ("step", 1, None, 8),  # alone: nobody is ahead
        ("step", 2, 9, 8),  # never past the job's last step (the old members would end without the joiner)
        ("enter", 2, 8, 7),
    ],
)
def test_the_switch_step_is_the_first_boundary_nobody_can_have_passed(
    where: str, world: int, end: int | None, at: int
) -> None:
    assert switch_proposal(where, 7, world, end) == at
    assert switches(at, at) and switches(at + 1, at) and not switches(at - 1, at)
