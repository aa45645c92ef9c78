"""Node-rank ordering from ``node_rank_hint`` (pure) and the hints published in a real store (a TCPStore)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import pytest
from torch.distributed import TCPStore

from elasticzero.rendezvous.ordering import (
    decode_hint,
    encode_hint,
    hint_key,
    order_ranks,
    publish_hint,
    ranks_by_hint,
    read_hints,
)
from ez_testing import free_port


def test_hints_decide_the_order() -> None:
    assert order_ranks([2, 0, 1]) == [2, 0, 1]
    assert order_ranks([10, 5, 7]) == [2, 0, 1]


def test_ties_and_missing_hints_keep_torch_order() -> None:
    assert order_ranks([1, 1, 0]) == [1, 2, 0]
    assert order_ranks([None, 0, None]) == [1, 0, 2]
    assert order_ranks([None, None]) == [0, 1]


def test_result_is_a_permutation() -> None:
    hints = [3, None, 3, 0, 9, None, 1]
    assert sorted(order_ranks(hints)) == list(range(len(hints)))


@pytest.mark.parametrize("hint", [None, 0, 17])
def test_hint_wire_form_round_trips(hint: int | None) -> None:
    assert decode_hint(encode_hint(hint)) == hint


class Node(NamedTuple):  # the fields of torch's _NodeDesc that name a hint key
    addr: str
    pid: int
    local_id: int


@pytest.fixture
def store() -> Iterator[TCPStore]:
    # a 60 s read timeout: a read that waited for a missing key would outlast the test's timeout
    yield TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=60))


@pytest.mark.timeout(30)
def test_ranks_follow_the_hints_published_in_the_store(store: TCPStore) -> None:
    nodes = [Node("10.0.0.1", 7, 0), Node("10.0.0.2", 7, 0), Node("10.0.0.3", 9, 1)]
    for node, hint in zip(nodes, [5, None, 1], strict=True):
        publish_hint(store, "run", node, hint)
    participants = {n: r for r, n in enumerate(nodes)}
    assert ranks_by_hint(store, "run", participants) == {nodes[0]: 1, nodes[1]: 2, nodes[2]: 0}


@pytest.mark.timeout(30)
def test_a_node_that_never_published_reads_as_unhinted_at_once(store: TCPStore) -> None:
    # every agent of ours publishes before joining; a key can only be missing for a foreign handler, and reading
    # must not wait on it (a wait here is a stalled rendezvous round)
    a, b, c = Node("a", 1, 0), Node("b", 1, 0), Node("c", 1, 0)
    publish_hint(store, "run", a, 3)
    publish_hint(store, "run", c, 0)
    assert read_hints(store, [hint_key("run", n) for n in (a, b, c)]) == [3, None, 0]
    assert ranks_by_hint(store, "run", {a: 0, b: 1, c: 2}) == {a: 1, b: 2, c: 0}


def test_keys_are_per_run_and_per_node() -> None:
    keys = {
        hint_key(run, Node(addr, pid, i))
        for run in ("r1", "r2")
        for addr in ("h", "g")
        for pid in (1, 2)
        for i in (0, 1)
    }
    assert len(keys) == 16


def test_a_single_node_needs_no_store() -> None:
    node = Node("h", 1, 0)
    assert ranks_by_hint(None, "run", {node: 0}) == {node: 0}  # type: ignore[arg-type]
