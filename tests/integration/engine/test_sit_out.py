"""A rank that computes nothing in a step sits it out (``ZeroOptimizer.sit_out``), on real gloo ranks: its reductions
add zeros, bucket by bucket in the others' order, and the others average over their own number
(``contributing``) — the step is then theirs alone, bit for bit: the same model and optimizer on a group of those ranks
alone, fed the same batches in the same run, ends at the same parameters (x + 0 is x, and the update is element-wise,
whatever the sharding). The building block of a join whose joiner takes part in the step its state arrives in
(issue 31). Then a step everyone computes (the world's mean again: no hang, every rank alike), and a sit-out after a
reduction is refused on every rank before it issues anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from ez_testing import run_ranks

WORKER = Path(__file__).with_name("sit_out_worker.py")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    ("world", "stage", "precision"), [(2, 2, "fp32"), (2, 1, "fp32"), (3, 2, "fp32"), (3, 1, "bf16")]
)
def test_a_step_sat_out_is_the_others_step(world: int, stage: int, precision: str, tmp_path: Path) -> None:
    ranks = run_ranks(WORKER, world, tmp_path / "sit", args=[str(stage), precision])
    computing, sitting = ranks[:-1], ranks[-1]
    assert all(r["sat_out"] == sitting["sat_out"] for r in computing)  # every rank holds the same parameters
    assert all(r["reference"] == sitting["sat_out"] for r in computing)  # and they are the reference's
    assert sitting["reference"] is None
    assert len({r["after"] for r in ranks}) == 1 and all(r["finite"] for r in ranks)
    assert all(r["after"] != r["sat_out"] for r in ranks)  # the third step moved them
    assert all("after this step's gradients were reduced" in r["refused"] for r in ranks)
    assert all(r["contributors"] == world and r["unsettled"] == 0 for r in ranks)
