"""Worker for test_comm_ranks: communicators on real gloo ranks; writes JSON results per rank.

Run as ``python comm_worker.py OUT`` with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import elasticzero
from elasticzero.engine.zero.comm.communicator import Communicator
from elasticzero.errors import UsageError

STEPS, REPLACE_AT = 4, 2


def ring_decision(n: int, r: int, out: dict[str, Any]) -> None:
    """The ring decision belongs to each communicator, made when it is built; both paths give the same gather."""
    with_ring = Communicator()
    os.environ["ELASTICZERO_GLOO_RING"] = "0"  # read by the next communicator only
    without = Communicator()
    del os.environ["ELASTICZERO_GLOO_RING"]
    out["uses_ring"] = [with_ring.uses_ring, without.uses_ring]
    mine = torch.arange(5, dtype=torch.float64) + 10 * r
    expect = torch.cat([torch.arange(5, dtype=torch.float64) + 10 * i for i in range(n)])
    gathered = [torch.empty(5 * n, dtype=torch.float64) for _ in range(2)]
    with_ring.all_gather(gathered[0], mine)
    without.all_gather(gathered[1], mine)
    out["gathers_equal"] = all(torch.equal(g, expect) for g in gathered)
    out["ring_stats"] = [c.stats.snapshot() for c in (with_ring, without)]


def build(stage: int, group: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    return model, cls(model, torch.optim.AdamW, lr=1e-2, process_group=group, bucket_bytes=128)


def train(model: nn.Module, opt: Any, scaler: Any, steps: range, rank: int) -> None:
    for i in steps:
        x = torch.linspace(-1.0, 1.0, 4 * 6).reshape(4, 6) * (i + 1) + rank  # each rank its own batch
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def replacement(stage: int, rank: int, out: dict[str, Any]) -> None:
    """Train, replace the communicator by one on a freshly created group of the same ranks, destroy the old group,
    train on: the result equals an optimizer that kept the default group throughout (same collectives, same ranks)."""
    ref_model, ref_opt = build(stage, None)
    train(ref_model, ref_opt, elasticzero.LossScaler(2.0**8), range(STEPS), rank)
    old_group = dist.new_group(list(range(dist.get_world_size())))
    model, opt = build(stage, old_group)
    scaler = elasticzero.LossScaler(2.0**8)
    train(model, opt, scaler, range(REPLACE_AT), rank)
    old = opt.communicator
    opt.communicator = Communicator(dist.new_group(list(range(dist.get_world_size()))), owner=type(opt).__name__)
    dist.destroy_process_group(old_group)
    del old_group
    train(model, opt, scaler, range(REPLACE_AT, STEPS), rank)
    ref, got = ref_opt.full_state_dict(), opt.full_state_dict()
    out[f"s{stage}_equal"] = all(torch.equal(got[k], ref[k]) for k in ref)
    out[f"s{stage}_old_closed"] = old.closed and opt.bucketer.communicator is opt.communicator
    out[f"s{stage}_found_inf_calls"] = scaler.comm_stats.calls[("all_reduce", "found_inf")]
    out[f"s{stage}_unsettled"] = opt.communicator.unsettled


def other_size(rank: int, out: dict[str, Any]) -> None:
    """A group of another size cannot take over an optimizer laid out for this world."""
    _, opt = build(2, None)
    sub = dist.new_group([0])  # every rank creates it; only rank 0 is in it
    try:
        opt.communicator = Communicator(sub)
        out["other_size"] = "accepted"
    except UsageError as e:
        out["other_size"] = str(e)
    out["kept"] = not opt.communicator.closed


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    ring_decision(n, r, out)
    for stage in (1, 2, 3):
        replacement(stage, r, out)
    other_size(r, out)
    dist.destroy_process_group()
    with open(f"{out_path}.rank{r}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
