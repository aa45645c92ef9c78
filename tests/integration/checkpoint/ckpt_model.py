"""Shared by the checkpoint workers: a tiny model with every kind of state (uneven parameter sizes, a tied weight,
a frozen parameter, a buffer), the world-size-independent batches, and full views of a ZeRO optimizer's state."""

from __future__ import annotations

import copy
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PlainState:
    """An AdamW state by parameter name (flat or shaped tensors): fp32 masters, both moments, the step count."""

    masters: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: float

    @classmethod
    def of(cls, full: dict[str, torch.Tensor]) -> PlainState:
        """From :func:`full_state`'s ``{name, name.exp_avg, name.exp_avg_sq, name.step}``."""
        names = [k for k in full if not k.endswith((".exp_avg", ".exp_avg_sq", ".step"))]
        moments = [{n: full[f"{n}.{k}"] for n in names} for k in ("exp_avg", "exp_avg_sq")]
        return cls({n: full[n] for n in names}, *moments, full[f"{names[0]}.step"].item())


def continue_plainly(
    start: PlainState, frozen: torch.Tensor, calls: int, steps: range, m: int, prec: str
) -> dict[str, torch.Tensor]:
    """``torch.optim.AdamW`` on ``tiny_net.Net`` from ``start`` (fp32 masters; float64 for ``prec="fp64"``, the
    truth), trained ``steps`` on the global batches, the gradient the mean of ``m`` slices' gradients as ``m``
    data-parallel ranks compute it; with ``prec`` bf16/fp16 each slice's forward and backward run on a copy of the
    masters in that dtype and the gradients are averaged in fp32 (what a ZeRO run in that precision does)."""
    dtype = torch.float64 if prec == "fp64" else torch.float32
    model = Net().to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        model.frozen.weight.copy_(frozen)
        for name, master in start.masters.items():
            params[name].copy_(master.reshape(params[name].shape))
    model.calls.fill_(calls)
    opt = torch.optim.AdamW([params[n] for n in start.masters], lr=LR, weight_decay=WD)
    state = {i: _moments(start, n, params[n].shape) for i, n in enumerate(start.masters)}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})  # casts to dtype
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec, dtype)
    for step in steps:
        for name, g in _mean_gradient(model, step, m, compute).items():
            params[name].grad = g.to(dtype)
        opt.step()
        opt.zero_grad()
    return {n: params[n].detach().clone() for n in start.masters}


def _mean_gradient(model: Net, step: int, m: int, compute: torch.dtype) -> dict[str, torch.Tensor]:
    """The mean over ``m`` equal slices of the global batch of each slice's gradient, computed on a copy of
    ``model`` in ``compute`` precision and summed in fp32 (fp64 for fp64)."""
    x, y, per = *batch(step), GLOBAL_BATCH // m
    total: dict[str, torch.Tensor] = {}
    for r in range(m):
        work = copy.deepcopy(model).to(compute)
        loss_of(work, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]).backward()
        for name, p in work.named_parameters():
            if p.grad is not None:
                g = p.grad.to(torch.promote_types(compute, torch.float32))
                total[name] = total[name] + g if name in total else g
    return {name: g / m for name, g in total.items()}


def _moments(start: PlainState, name: str, shape: torch.Size) -> dict[str, torch.Tensor]:
    moments = {"exp_avg": start.exp_avg[name].reshape(shape), "exp_avg_sq": start.exp_avg_sq[name].reshape(shape)}
    return {"step": torch.tensor(float(start.step)), **moments}
