"""--include/--exclude/--num-nodes/--num-gpus over a pool: DeepSpeed semantics with its bugs fixed."""

from __future__ import annotations

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.filters import apply_filters, parse_filter, select_first
from elasticzero.launch.hostfile import ResourcePool

POOL: ResourcePool = {"worker-0": (0, 1, 2, 3), "worker-1": (0, 1, 2, 3), "worker-2": (0, 1)}
W: ResourcePool = {"w0": (0, 1), "w1": (0, 1, 2)}


def test_include_whole_node_keeps_all_its_slots() -> None:
    assert apply_filters(POOL, "worker-0", None) == {"worker-0": (0, 1, 2, 3)}


def test_include_node_and_slot_keeps_both() -> None:
    assert apply_filters(W, "w0@w1:0", None) == {"w0": (0, 1), "w1": (0,)}


def test_include_follows_hostfile_order_not_filter_order() -> None:
    out = apply_filters(POOL, "worker-2@worker-0:3,1", None)
    assert list(out.items()) == [("worker-0", (1, 3)), ("worker-2", (0, 1))]


def test_include_same_host_twice_merges() -> None:
    assert apply_filters(W, "w1:2@w1:0", None) == {"w1": (0, 2)}
    assert apply_filters(W, "w1:2@w1", None) == {"w1": (0, 1, 2)}


def test_include_slot_the_host_does_not_have_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"^--include 'w0:5': host 'w0' has no slot 5; its slots are 0,1"):
        apply_filters(W, "w0:5", None)


@pytest.mark.parametrize(("inc", "exc"), [("nope", None), ("w0@nope:1", None), (None, "nope")])
def test_unknown_host_is_an_error(inc: str | None, exc: str | None) -> None:
    with pytest.raises(UsageError, match=r"unknown host 'nope'; hostfile has: w0, w1$"):
        apply_filters(W, inc, exc)


def test_include_with_exclude_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"^--include and --exclude cannot be combined"):
        apply_filters(W, "w0", "w1")


def test_exclude_slots() -> None:
    assert apply_filters(POOL, None, "worker-0:0,2@worker-2:1") == {
        "worker-0": (1, 3),
        "worker-1": (0, 1, 2, 3),
        "worker-2": (0,),
    }


def test_excluding_every_slot_of_a_host_drops_the_host() -> None:
    out = apply_filters(POOL, None, "worker-2:0,1")
    assert list(out) == ["worker-0", "worker-1"]
    assert list(apply_filters(POOL, None, "worker-1")) == ["worker-0", "worker-2"]


def test_exclude_everything_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"removes every slot; nothing left to launch"):
        apply_filters(W, None, "w0@w1")


def test_exclude_missing_slot_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"^--exclude 'w1:9': host 'w1' has no slot 9"):
        apply_filters(W, None, "w1:9")


def test_no_filter_returns_a_copy() -> None:
    out = apply_filters(W, None, None)
    assert out == W
    assert out is not W


def test_ipv6_hosts_are_bracketed_in_filters() -> None:
    pool: ResourcePool = {"fe80::1": (0, 1, 2), "10.0.0.1": (0, 1)}
    assert apply_filters(pool, "[fe80::1]:0,2@10.0.0.1:1", None) == {"fe80::1": (0, 2), "10.0.0.1": (1,)}
    assert apply_filters(pool, "[FE80::0001]", None) == {"fe80::1": (0, 1, 2)}
    assert apply_filters(pool, None, "[fe80::1]") == {"10.0.0.1": (0, 1)}


@pytest.mark.parametrize(
    ("expr", "words"),
    [
        ("fe80::1:0", "IPv6 hosts must be bracketed in filters, e.g. [fe80::1]"),
        ("[fe80::1:0", "missing ']'"),
        ("[fe80::1]0", "unexpected '0' after [fe80::1]"),
        ("w0:", "bad slot '' for w0"),
        ("w0:a", "bad slot 'a' for w0"),
        ("w0:-1", "bad slot '-1' for w0"),
        ("w0@", "empty node between '@'"),
        ("@w0", "empty node between '@'"),
        ("", "needs a value"),
        ("w0@-x", "starts with '-'"),
    ],
)
def test_bad_filter_syntax(expr: str, words: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_filter(expr, "--include")
    assert str(err.value).startswith("--include")
    assert words in str(err.value)


def test_num_nodes_keeps_first_hosts_in_order() -> None:
    assert list(select_first(POOL, 2, None)) == ["worker-0", "worker-1"]


def test_num_gpus_keeps_first_remaining_slot_ids() -> None:
    pool = apply_filters(POOL, None, "worker-0:0")
    assert select_first(pool, None, 2) == {"worker-0": (1, 2), "worker-1": (0, 1), "worker-2": (0, 1)}


def test_num_gpus_larger_than_a_host_is_an_error() -> None:
    with pytest.raises(UsageError, match=r"^--num-gpus 3 but host 'worker-2' has only 2 slot\(s\)"):
        select_first(POOL, None, 3)


def test_num_gpus_contradicting_an_include_is_an_error() -> None:
    pool = apply_filters(POOL, "worker-0:1", None)
    with pytest.raises(UsageError, match=r"^--num-gpus 2 but host 'worker-0' has only 1 slot\(s\) \(hostfile, after"):
        select_first(pool, None, 2)


def test_num_nodes_larger_than_hosts_after_filters_is_an_error() -> None:
    pool = apply_filters(POOL, "worker-1", None)
    with pytest.raises(UsageError, match=r"^--num-nodes 2 but only 1 host\(s\) available"):
        select_first(pool, 2, None)


@pytest.mark.parametrize(("nodes", "gpus"), [(0, None), (None, 0), (-1, None)])
def test_non_positive_counts_are_errors(nodes: int | None, gpus: int | None) -> None:
    with pytest.raises(UsageError, match=r"must be at least 1"):
        select_first(POOL, nodes, gpus)


def test_host_names_match_case_insensitively_keeping_the_pool_spelling() -> None:
    pool: ResourcePool = {"Worker-0": (0, 1), "worker-1": (0, 1, 2)}
    assert apply_filters(pool, "worker-0", None) == {"Worker-0": (0, 1)}
    assert apply_filters(pool, "WORKER-0:1@Worker-1:2", None) == {"Worker-0": (1,), "worker-1": (2,)}
    assert apply_filters(pool, None, "WORKER-1:0") == {"Worker-0": (0, 1), "worker-1": (1, 2)}
    assert apply_filters(pool, None, "worker-0") == {"worker-1": (0, 1, 2)}


def test_different_spellings_of_one_host_merge() -> None:
    pool: ResourcePool = {"Worker-0": (0, 1, 2), "w1": (0,)}
    assert parse_filter("w0:0@W0:2", "--include") == {"w0": (0, 2)}
    assert apply_filters(pool, "worker-0:0@WORKER-0:2", None) == {"Worker-0": (0, 2)}
    assert apply_filters(pool, "worker-0:0@Worker-0", None) == {"Worker-0": (0, 1, 2)}


def test_case_insensitive_match_still_checks_slots_with_the_pool_spelling() -> None:
    pool: ResourcePool = {"Worker-0": (0, 1)}
    with pytest.raises(UsageError) as err:
        apply_filters(pool, "worker-0:5", None)
    assert str(err.value) == "--include 'worker-0:5': host 'Worker-0' has no slot 5; its slots are 0,1 (hostfile)"
