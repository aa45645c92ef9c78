"""Shared by the checkpoint workers: a tiny model with every kind of state (uneven parameter sizes, a tied weight,
a frozen parameter, a buffer), the world-size-independent batches, and full views of a ZeRO optimizer's state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tiny_net import GLOBAL_BATCH, LR, WD, Net, batch, loss_of

from elasticzero.engine.zero.stage1 import ZeroStage1
from elasticzero.engine.zero.stage2 import ZeroStage2
from elasticzero.engine.zero.stage3 import ZeroStage3

STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def build(stage: int, precision: str, group: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    model = Net()
    return STAGES[stage](model, torch.optim.AdamW, lr=LR, weight_decay=WD, precision=precision, process_group=group)


def train(opt: Any, steps: range) -> None:
    """Each rank of the optimizer's group takes its slice of the same global batch (the mean of the ranks' means is
    the global mean)."""
    n, r = opt.world_size, opt.rank
    per = GLOBAL_BATCH // n
    for step in steps:
        x, y = batch(step)
        loss_of(opt.module, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def full_state(opt: Any) -> dict[str, torch.Tensor]:
    """``{name: full fp32 master}`` and ``{name.exp_avg: ...}`` / ``{name.exp_avg_sq: ...}`` / ``{name.step: ...}``
    assembled from every rank's pieces (collective over the optimizer's group)."""
    pieces = {}
    for b, m in zip(opt.buckets, opt.masters, strict=True):
        st = opt.optim.state.get(m, {})
        for name, start, end, off in b.local_pieces():
            pieces[name] = (start, m.detach()[off : off + end - start].clone())
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    pieces[f"{name}.{k}"] = (start, st[k][off : off + end - start].clone())
        for name in b.names:
            if "step" in st:
                pieces[f"{name}.step"] = (0, st["step"].reshape(1).clone())
    parts: list[Any] = [None] * opt.world_size
    dist.all_gather_object(parts, pieces, group=opt.process_group)
    full: dict[str, torch.Tensor] = {}
    for key in sorted({k for p in parts for k in p}):
        name = key.split(".exp_avg")[0].removesuffix(".step")
        numel = 1 if key.endswith(".step") else opt.partition[name].numel
        t = torch.full((numel,), float("nan"))
        for p in parts:
            if key in p:
                start, v = p[key]
                t[start : start + v.numel()] = v
        full[key] = t
    return full


def mismatches(opt: Any, ref: dict[str, torch.Tensor]) -> list[str]:
    """Keys where this rank's pieces differ (bitwise) from the reference full state."""
    mine = full_state(opt)
    bad = [k for k in ref if k not in mine or not torch.equal(ref[k], mine[k])]
    return bad + [k for k in mine if k not in ref]
