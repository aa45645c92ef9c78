"""Worker for test_step_path: ZeroStage2's reused buffers on real gloo ranks, against ZeroStage1 on the same batches.
Writes JSON results per rank."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2

STEPS = 3
BUCKET_BYTES = 272 * 4 + 16


def model() -> nn.Module:
    """Five equal layers, a bucket each (BUCKET_BYTES holds one layer's 272 elements, not two)."""
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(5) for m in (nn.Linear(16, 16), nn.Tanh())))


def train(opt: Any, rank: int, on_step: Any = None) -> None:
    for i in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * i + rank))
        opt.module(x).square().mean().backward()
        if on_step is not None:
            on_step(opt)
        opt.step()
        opt.zero_grad()


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "bucket_bytes": BUCKET_BYTES, "max_inflight": 1}
    one = ZeroStage1(model(), torch.optim.AdamW, **kw)
    train(one, rank)
    two = ZeroStage2(model(), torch.optim.AdamW, **kw)
    fresh: list[int] = []  # per bucket buffer taken during backward: 1 newly allocated, 0 a reduced one reused
    take = two.bucketer._transient

    def counting(bucket: Any) -> torch.Tensor:
        before = len(two.bucketer._spares)
        buf = take(bucket)
        fresh.append(int(len(two.bucketer._spares) == before))
        return buf

    two.bucketer._transient = counting  # type: ignore[method-assign]  # observe, do not change
    shard_ptrs: list[list[int]] = []
    fresh_by_step: list[int] = []
    taken_by_step: list[int] = []

    def after_backward(o: Any) -> None:
        shard_ptrs.append([m.grad.data_ptr() for m in o.masters])
        fresh_by_step.append(sum(fresh))
        taken_by_step.append(len(fresh))
        fresh.clear()

    train(two, rank, after_backward)
    a, b = one.full_state_dict(), two.full_state_dict()
    results = {
        "buckets": len(two.buckets),
        "fresh_by_step": fresh_by_step,
        "taken_by_step": taken_by_step,
        "spares": len(two.bucketer.spare_buffers()),
        "scratch_bytes": two.memory_report()["scratch"],
        "shards_kept": all(p == shard_ptrs[0] for p in shard_ptrs),
        "held_after_backward": two.bucketer.held_buffers() == [],
        "stage2_equals_stage1": all(torch.equal(a[k], b[k]) for k in a),
        "unsettled": two.communicator.unsettled,
    }
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
