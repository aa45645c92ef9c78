"""Shared by the checkpoint workers: a tiny model with every kind of state (uneven parameter sizes, a tied weight,
a frozen parameter, a buffer), the world-size-independent batches, and full views of a ZeRO optimizer's state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticzero.engine.zero.stage1 import ZeroStage1
from elasticzero.engine.zero.stage2 import ZeroStage2
from elasticzero.engine.zero.stage3 import ZeroStage3

STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
GLOBAL_BATCH = 6  # divisible by every world size used (1, 2, 3)
VOCAB = 11


class Scale(nn.Module):
    """One element: on 2 or 3 ranks its bucket leaves some ranks only padding."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.g


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 7), nn.Linear(7, 6), Scale()])
        self.frozen = nn.Linear(6, 6)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h)) if isinstance(b, nn.Linear) else b(h)
        return self.head(self.frozen(h))


def build(stage: int, precision: str, group: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    model = Net()
    return STAGES[stage](model, torch.optim.AdamW, lr=0.05, weight_decay=0.1, precision=precision, process_group=group)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, 5), generator=g)
    return x, torch.roll(x, 1, dims=1)


def train(opt: Any, steps: range) -> None:
    """Each rank of the optimizer's group takes its slice of the same global batch (the mean of the ranks' means is
    the global mean)."""
    n, r = opt.world_size, opt.rank
    per = GLOBAL_BATCH // n
    for step in steps:
        x, y = batch(step)
        out = opt.module(x[r * per : (r + 1) * per])
        loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB).float(), y[r * per : (r + 1) * per].reshape(-1))
        loss.backward()
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
