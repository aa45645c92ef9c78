"""Slurm host-list and per-node count expansion (no scontrol)."""

from __future__ import annotations

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.hostlist import expand_counts, expand_hostlist


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3,5],gpu[01-02]", ["node1", "node2", "node3", "node5", "gpu01", "gpu02"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("a,b,c", ["a", "b", "c"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[7]-ib", ["x7-ib"]),
        ("n[1-10]", [f"n{i}" for i in range(1, 11)]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("n[1-3", "unbalanced '['"),
        ("n1-3]", "unbalanced ']'"),
        ("n[3-1]", "runs backwards"),
        ("n[a-b]", "bad range 'a-b'"),
        ("n1,,n2", "empty entry"),
        ("n[[1]]", "nested '['"),
    ],
)
def test_bad_hostlist(text: str, words: str) -> None:
    with pytest.raises(UsageError, match=r"^SLURM_JOB_NODELIST=") as err:
        expand_hostlist(text)
    assert words in str(err.value)


@pytest.mark.parametrize(("text", "counts"), [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,2(x2)", [1, 2, 2])])
def test_expand_counts(text: str, counts: list[int]) -> None:
    assert expand_counts(text) == counts


@pytest.mark.parametrize("text", ["2(3)", "x", "2(x)", ""])
def test_bad_counts(text: str) -> None:
    with pytest.raises(UsageError, match=r"^SLURM_TASKS_PER_NODE=.*expected N or N\(xR\)"):
        expand_counts(text)
