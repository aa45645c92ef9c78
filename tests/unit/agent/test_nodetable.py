"""Node table parsing and identity resolution (pure functions, no network)."""

from __future__ import annotations

import pytest

from elasticzero.agent.nodetable import (
    HostFacts,
    NodeRow,
    bare_host,
    match_local_host,
    parse_node_table,
    rank_from_env,
    rank_of_host,
)
from elasticzero.errors import UsageError

TABLE = (NodeRow("worker-0", (0, 1)), NodeRow("alice@worker-1.example.org", (2,)), NodeRow("[fe80::1]", (0,)))


def test_parse_round_trip() -> None:
    rows = parse_node_table('[["a",[0,1]],["b",[3]]]')
    assert rows == (NodeRow("a", (0, 1)), NodeRow("b", (3,)))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[[", "not valid JSON"),
        ("[]", "non-empty JSON list"),
        ('{"a": [0]}', "non-empty JSON list"),
        ('[["a"]]', "entry 0 must be [host"),
        ('[["a", []]]', "non-empty slot list"),
        ('[["a", [-1]]]', "not non-negative integers"),
        ('[["a", [true]]]', "not non-negative integers"),
        ('[["a", [0, 0]]]', "repeats a slot"),
        ('[["a", [0]], ["a", [1]]]', "twice"),
    ],
)
def test_parse_errors(text: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment.replace("[", r"\[")):
        parse_node_table(text)


def test_bare_host() -> None:
    assert bare_host("u@h") == "h"
    assert bare_host("[::1]") == "::1"
    assert bare_host("h") == "h"


def test_rank_from_env() -> None:
    assert rank_from_env("OMPI_COMM_WORLD_RANK", {"OMPI_COMM_WORLD_RANK": " 3 "}) == 3
    with pytest.raises(UsageError, match="not set"):
        rank_from_env("PMI_RANK", {})
    with pytest.raises(UsageError, match="not an integer"):
        rank_from_env("PMI_RANK", {"PMI_RANK": "x"})


def test_rank_of_host_exact_user_and_short_names() -> None:
    assert rank_of_host("worker-0", TABLE, "--node-host") == 0
    assert rank_of_host("worker-1.example.org", TABLE, "--node-host") == 1
    assert rank_of_host("worker-1", TABLE, "--node-host") == 1  # short name of an FQDN entry
    assert rank_of_host("fe80::1", TABLE, "--node-host") == 2
    with pytest.raises(UsageError, match="not in the node table"):
        rank_of_host("worker-9", TABLE, "--node-host")


def test_rank_of_host_ambiguous_short_name() -> None:
    table = (NodeRow("n1.a", (0,)), NodeRow("n1.b", (0,)))
    with pytest.raises(UsageError, match="several"):
        rank_of_host("n1", table, "--node-host")


def test_match_by_name_then_address() -> None:
    facts = HostFacts(frozenset({"worker-0"}), frozenset({"10.0.0.5"}))
    assert match_local_host(TABLE, facts, {}) == 0
    facts = HostFacts(frozenset({"other"}), frozenset({"10.0.0.7", "127.0.0.1"}))
    resolved = {"worker-0": {"10.0.0.5"}, "alice@worker-1.example.org": {"10.0.0.7"}}
    assert match_local_host(TABLE, facts, resolved) == 1


def test_match_ambiguous_or_missing() -> None:
    facts = HostFacts(frozenset({"other"}), frozenset({"127.0.0.1"}))
    table = (NodeRow("localhost", (0,)), NodeRow("127.0.0.1", (0,)))
    resolved = {"localhost": {"127.0.0.1"}, "127.0.0.1": {"127.0.0.1"}}
    with pytest.raises(UsageError, match="several node-table entries"):
        match_local_host(table, facts, resolved)
    with pytest.raises(UsageError, match="is not in the node table"):
        match_local_host(TABLE, facts, {})
