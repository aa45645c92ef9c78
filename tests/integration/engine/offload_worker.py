"""Rank worker of test_offload_ranks: each rank trains every stage with ZeRO-Offload's host path (``cpu_copies``)
and without it, on its own micro-batches, and reports how far the offloaded run is from the plain one by the
ez_numerics rule (a float64 single-process run over the global batch is the truth)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.step import optimizer_step
from elasticzero.engine.zero.offload import OffloadOptions
from ez_numerics import error_ratio

STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
LR, WD, MAX_NORM, STEPS = 2e-2, 0.1, 0.05, 3
SCENARIOS = {  # name -> (offload, clip, accumulation, step in backward)
    "all": (OffloadOptions(optimizer=True, cpu_copies=True), True, 2, False),
    "early": (OffloadOptions(optimizer=True, cpu_copies=True), False, 1, True),
    "half": (OffloadOptions(optimizer=True, ratio=0.5, cpu_copies=True), False, 2, True),
}


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(10000 * step + 100 * micro + rank))


def train(opt: Any, rank: int, clip: bool, accum: int, early: bool) -> None:
    for step in range(STEPS):
        for micro in range(accum):
            last = micro == accum - 1
            sync = opt.no_sync() if not last and opt.supports_no_sync else torch.enable_grad()
            arm = opt.stepping_in_backward(clipping=clip) if early and last else torch.enable_grad()
            with sync, arm:
                (opt.module(batch(step, micro, rank)).square().mean() / accum).backward()
        optimizer_step(opt, max_norm=MAX_NORM if clip else None)


def truth(world: int, clip: bool, accum: int) -> dict[str, torch.Tensor]:
    net = model().double()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in range(STEPS):
        for micro in range(accum):
            for rank in range(world):
                (net(batch(step, micro, rank).double()).square().mean() / (accum * world)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in net.state_dict().items()}


def run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage, cls in STAGES.items():
        for name, (offload, clip, accum, early) in SCENARIOS.items():
            runs = []
            for options in (offload, None):
                opt = cls(model(), torch.optim.AdamW, bucket_bytes=512, offload=options, lr=LR, weight_decay=WD)
                train(opt, rank, clip, accum, early)
                runs.append({k: v.double() for k, v in opt.full_state_dict().items()})
                out[f"stage{stage}_{name}_{'host' if options else 'device'}_offloaded"] = sum(
                    opt.home(i).host for i in range(len(opt.masters))
                )
            out[f"stage{stage}_{name}_ratio"] = error_ratio(runs[0], runs[1], truth(world, clip, accum))
    return out


def worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    target = Path(f"{path}.rank{rank}")
    try:
        target.write_text(json.dumps(run(rank, world)))
    except Exception as exc:
        target.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise
    finally:
        dist.destroy_process_group()
