"""One rank of the shutdown test: train with every engine piece, destroy the process group, report threads.

Run as ``python shutdown_worker.py OUT [late]`` with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set. Writes
``OUT.rank<r>`` (JSON): the process's thread count before ``init_process_group`` and after ``destroy_process_group``
while every engine object is still alive, and the error each object gives when used after the destroy. ``late``:
the engine (and with it torch.distributed.nn) is imported only after ``init_process_group``, which pins the default
group in torch's default arguments until the first engine object unpins it.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import elasticzero
from elasticzero.errors import UsageError


def threads() -> int:
    """Threads of this process (gloo adds its worker and transport threads while a group is alive)."""
    return len(os.listdir("/proc/self/task"))


def main(out: str, late: bool) -> None:
    # torch.distributed.nn binds the default group in default arguments when imported after init_process_group
    # (torch._dynamo imports it, on the first torch.optim optimizer) and keeps it alive; the engine's comm module,
    # imported before init like a script imports the engine, imports it first, so it binds None. Imported late, the
    # first communicator opened on the default group (stage 1's) puts None back.
    torch.set_num_threads(1)
    if not late:
        from elasticzero.engine.zero import comm
    before = threads()
    dist.init_process_group("gloo")
    if late:
        from elasticzero.engine.zero import comm
    pinned_at_import = comm.default_group_pinned()
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # an explicit group, passed to the scaler and one optimizer
    torch.manual_seed(0)
    keep = []
    unsettled = []  # tensors a backend thread may still hold after each step (must be none)
    for stage in (1, 2, 3):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
        pg = group if stage == 2 else None
        opt = getattr(elasticzero, f"ZeroStage{stage}")(model, torch.optim.AdamW, lr=1e-3, process_group=pg)
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            unsettled.append(opt.communicator.unsettled)
        keep.append(opt)
    ddp_like = nn.Linear(64, 64)
    bucketer = elasticzero.GradBucketer(ddp_like.parameters())
    ddp_like(torch.randn(4, 64)).sum().backward()
    unsettled.append(bucketer.communicator.unsettled)
    scaler = elasticzero.LossScaler(process_group=group)
    del group, pg
    pinned = comm.default_group_pinned()
    dist.all_reduce(torch.ones(4))  # the script's own last collective, which no engine settle covers
    live = threads()
    dist.destroy_process_group()
    after = threads()
    errors = {}
    for name, obj in [("stage1", keep[0]), ("stage2", keep[1]), ("stage3", keep[2]), ("bucketer", bucketer)]:
        try:
            obj.process_group  # noqa: B018 - the property is what is tested
        except UsageError as e:
            errors[name] = str(e)
    try:
        scaler.process_group  # noqa: B018
    except UsageError as e:
        errors["scaler"] = str(e)
    with open(f"{out}.rank{rank}", "w") as f:
        report = {"unsettled": unsettled, "before_init": before, "live": live, "after_destroy": after, "pinned": pinned}
        report["pinned_at_import"] = pinned_at_import
        json.dump({**report, "errors": errors}, f)


if __name__ == "__main__":
    main(sys.argv[1], late=sys.argv[2:] == ["late"])
