"""Node-rank ordering from ``node_rank_hint`` (pure) and its exchange through a real store."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from elasticzero.rendezvous.ordering import decode_hint, encode_hint, exchange_and_order, order_ranks
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


@pytest.mark.timeout(30)
def test_exchange_through_a_tcpstore() -> None:
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    hints = [5, None, 1]
    results: dict[int, int] = {}

    def node(rank: int) -> None:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        results[rank] = exchange_and_order(store, rank, 3, hints[rank])

    threads = [threading.Thread(target=node, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    del server
    assert results == {0: 1, 1: 2, 2: 0}
