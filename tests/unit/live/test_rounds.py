"""The round file: parsing and the worker's decision are pure (errors as data); the reader and the writer use a real
file (the agent's side writes it, the workers poll it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticzero.live.rounds import (
    NodeRound,
    RoundError,
    RoundFile,
    StoreAddress,
    decide_node,
    parse_node_round,
    write_round,
)

STORE = StoreAddress("10.0.0.1", 29400, False)


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
