"""ZeroStage2's step path on real gloo ranks (2 and 3): the fp32 gradient shards are allocated once and rewritten
every step, bucket buffers are reused (at most ``max_inflight + 1`` kept as spares, none held as live buffers once a
backward ends), and the result is bitwise ZeroStage1's on the same batches (the same reductions and the same fused
AdamW, only the buffers differ)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ez_testing import run_ranks

WORKER = Path(__file__).with_name("step_path_worker.py")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


@pytest.mark.parametrize("world", [2, 3])
def test_stage2_reuses_its_buffers_and_equals_stage1(world: int, tmp_path: Path) -> None:
    for res in run_ranks(WORKER, world, tmp_path / "step"):
        assert res["buckets"] >= 3 and all(n == res["buckets"] for n in res["taken_by_step"])
        # max_inflight=1: the first backward allocates the bucket in flight and the one filling, the others reuse
        # them; later backwards reuse the two kept spares and allocate nothing
        first, *later = res["fresh_by_step"]
        assert first <= 2 < res["buckets"] and later == [0] * len(later)
        assert res["spares"] == 2 and res["scratch_bytes"] > 0  # kept, and reported apart from the model state
        assert res["shards_kept"] and res["held_after_backward"]
        assert res["stage2_equals_stage1"] and res["unsettled"] == 0
