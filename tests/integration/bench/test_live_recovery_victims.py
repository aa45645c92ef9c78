"""``bench/live_recovery_bench.py --victim-rank alternate``: the lost node's rank alternates within each kind of loss,
so that kills and freezes run in turn each lose rank 1 and rank 0 alike (alternating over all losses, every kill
lost rank 1 and every freeze rank 0: the two kinds were compared on different survivors)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "bench")]

from live_recovery_bench import victim_rank  # noqa: E402


@pytest.mark.parametrize("kinds", [1, 2, 3])
def test_each_kind_loses_rank_1_then_rank_0_in_turn(kinds: int) -> None:
    ranks = [victim_rank("alternate", loss, kinds) for loss in range(4 * kinds)]
    for kind in range(kinds):  # the job loses the kinds in turn: loss n is of kind n % kinds
        assert ranks[kind::kinds] == [1, 0, 1, 0]


@pytest.mark.parametrize("choice", ["0", "1"])
def test_a_fixed_rank_is_every_loss_s(choice: str) -> None:
    assert {victim_rank(choice, loss, 2) for loss in range(6)} == {int(choice)}
