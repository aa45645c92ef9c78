"""Communicators on real gloo ranks (engine/zero/comm/): the ring decision per communicator, an optimizer whose
communicator is replaced by one on a freshly created group keeps training exactly as one that never changed groups,
and a group of another size is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ez_testing import run_ranks

WORKER = Path(__file__).with_name("comm_worker.py")
STEPS = 4  # comm_worker.STEPS: one overflow-flag agreement per step


def _run(world: int, out: Path) -> list[dict[str, Any]]:
    return run_ranks(WORKER, world, out)


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(request.param, tmp_path_factory.mktemp("comm") / "result")


def test_ring_decision_is_per_communicator(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["uses_ring"] == [True, False], r
        assert r["gathers_equal"] is True, r
        assert r["ring_stats"][0] == r["ring_stats"][1] == {"all_gather:param": 5 * len(ranks)}, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replaced_communicator_trains_on_exactly(ranks: list[dict[str, Any]], stage: int) -> None:
    for r in ranks:
        assert r[f"s{stage}_equal"] is True, r
        assert r[f"s{stage}_old_closed"] is True, r
        assert r[f"s{stage}_found_inf_calls"] == STEPS, r  # the scaler followed the optimizer to the new group
        assert r[f"s{stage}_unsettled"] == 0, r


def test_group_of_another_size_is_refused(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    assert f"laid out for rank 0 of {world}" in ranks[0]["other_size"], ranks[0]
    assert "of 1" in ranks[0]["other_size"], ranks[0]
    for r in ranks[1:]:
        assert "this process is not in the group" in r["other_size"], r
    assert all(r["kept"] for r in ranks)
