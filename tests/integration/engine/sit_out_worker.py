"""Worker for test_sit_out: the last rank sits two steps out (``opt.sit_out()``), the others compute them inside
``opt.contributing(world - 1)``; beside them, on a group of those ranks alone, the same model and optimizer take the
same batches (the reference, in the same run). Then a step everyone computes, and the refusal of a sit-out after a
reduction. Argv: out path, stage (1 or 2), precision. Writes JSON results per rank."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2
from elasticzero.errors import UsageError

STAGES = {1: ZeroStage1, 2: ZeroStage2}
#: one layer's 272 elements per bucket (five buckets): reductions launch during backward, bucket by bucket
BUCKET_BYTES = 272 * 4 + 16


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(5) for m in (nn.Linear(16, 16), nn.Tanh())))


def loss(module: nn.Module, step: int, rank: int, micro: int) -> torch.Tensor:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))
    return module(x).square().mean() / 2  # two micro-batches a step, averaged


def digest(module: nn.Module) -> str:
    """The module's parameters, bit for bit."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def backward(opt: Any, step: int, rank: int) -> None:
    """A step's two micro-batches, the first under ``no_sync``: one round of reductions a step, as a rank sitting
    out issues (a backward outside ``no_sync`` reduces each time)."""
    with opt.no_sync():
        loss(opt.module, step, rank, 0).backward()
    loss(opt.module, step, rank, 1).backward()


def computed_step(opt: Any, step: int, rank: int) -> None:
    backward(opt, step, rank)
    opt.step()
    opt.zero_grad()


def main(out: str, stage: int, precision: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "bucket_bytes": BUCKET_BYTES, "max_inflight": 1}
    kw["precision"] = precision
    computing = list(range(world - 1))
    ref_group = dist.new_group(computing)  # every rank calls new_group; only its members use it
    opt = STAGES[stage](model(), torch.optim.AdamW, **kw)
    ref = STAGES[stage](model(), torch.optim.AdamW, process_group=ref_group, **kw) if rank in computing else None
    for step in range(2):
        if rank in computing:
            with opt.contributing(len(computing)):
                backward(opt, step, rank)
            computed_step(ref, step, rank)
        else:
            opt.sit_out()
        opt.step()
        opt.zero_grad()
    sat_out = digest(opt.module)
    reference = digest(ref.module) if ref is not None else None
    computed_step(opt, 2, rank)  # everyone computes: the reductions and the mean are the world's again
    after = digest(opt.module)
    loss(opt.module, 3, rank, 0).backward()  # a reduction in this step: a sit-out now would start a second round
    try:
        opt.sit_out()
        refused = ""
    except UsageError as exc:
        refused = str(exc)
    opt.zero_grad()
    results = {
        "sat_out": sat_out,
        "reference": reference,
        "after": after,
        "finite": all(bool(torch.isfinite(p).all()) for p in opt.module.parameters()),
        "refused": refused,
        "contributors": opt.bucketer.contributors,
        "unsettled": opt.communicator.unsettled,
    }
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
