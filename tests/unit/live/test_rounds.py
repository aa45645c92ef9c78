"""The round key: parsing and the worker's decision are pure (errors as data); the source reads a real TCPStore."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from elasticzero.live.rounds import ROUND_KEY, Round, RoundError, RoundSource, announce, decide, parse_round
from ez_testing import free_port

pytestmark = pytest.mark.timeout(60)


def raw(**doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_a_round_round_trips_through_its_json() -> None:
    r = Round(3, ((0, 0), (2, 1)), "round3/")
    assert parse_round(r.to_json().encode()) == r
    assert (r.world_size, r.new_rank(2), r.new_rank(1), r.old_ranks()) == (2, 1, None, [0, 2])


def test_members_are_put_in_new_rank_order() -> None:
    assert parse_round(raw(round=1, members={"2": 0, "0": 1}, prefix="p/")) == Round(1, ((2, 0), (0, 1)), "p/")


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"not json", "not a round"),
        (raw(round=1, prefix="p/"), "not a round"),
        (raw(round=1, members=[0, 1], prefix="p/"), "not a round"),
        (raw(round=-1, members={"0": 0}, prefix="p/"), "not a non-negative integer"),
        (raw(round="1", members={"0": 0}, prefix="p/"), "not a non-negative integer"),
        (raw(round=1, members={"0": 0, "1": 2}, prefix="p/"), "not 0..M-1 once each"),
        (raw(round=1, members={"0": 0, "1": 0}, prefix="p/"), "not 0..M-1 once each"),
        (raw(round=1, members={"-1": 0}, prefix="p/"), "not 0..M-1 once each"),
        (raw(round=1, members={"0": 0}, prefix=""), "no store prefix"),
    ],
)
def test_what_is_not_a_round_is_an_error_naming_the_key(data: bytes, says: str) -> None:
    found = parse_round(data)
    assert isinstance(found, RoundError) and ROUND_KEY in found.reason and says in found.reason


def test_a_worker_acts_only_on_a_newer_round() -> None:
    r = Round(2, ((0, 0),), "round2/").to_json().encode()
    assert decide(None, 0) is None
    assert decide(r, 2) is None and decide(r, 3) is None
    assert decide(r, 1) == Round(2, ((0, 0),), "round2/")
    assert isinstance(decide(b"{", 5), RoundError)  # a broken key is reported whatever the round


def test_the_source_reads_the_key_an_announcement_writes() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    source = RoundSource(store)
    assert source.read() is None and source.poll(0) is None  # never blocks on a missing key
    announce(store, Round(1, ((1, 0),), "round1/"))
    assert source.poll(0) == Round(1, ((1, 0),), "round1/") and source.poll(1) is None
