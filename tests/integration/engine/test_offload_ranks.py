"""ZeRO-Offload's host path (``cpu_copies``: separate host masters and gradients, per-bucket steps, pushes) on real
gloo ranks, where stages 1/2/3 reduce into shards of their own (transient stage-2/3 shards, stage 1's scratch):
every stage trains like the same stage without offload, by the ez_numerics rule, with clipping and accumulation,
the step in backward, and half of the state offloaded."""

from __future__ import annotations

import json
from typing import Any

import offload_worker
import pytest
import torch.multiprocessing as mp

from ez_testing import free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("offload")
    path = tmp / "result.json"
    mp.spawn(offload_worker.worker, args=(2, free_port(), str(path)), nprocs=2, join=True)
    return [json.loads((tmp / f"result.json.rank{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("scenario", sorted(offload_worker.SCENARIOS))
def test_offloaded_ranks_train_like_resident_ones(report: list[dict[str, Any]], stage: int, scenario: str) -> None:
    for rank in report:
        assert "error" not in rank, rank["error"]
        assert rank[f"stage{stage}_{scenario}_host_offloaded"] > 0
        assert rank[f"stage{stage}_{scenario}_device_offloaded"] == 0
        assert rank[f"stage{stage}_{scenario}_ratio"] <= 1.0
