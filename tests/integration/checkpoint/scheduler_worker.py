"""Driver for test_ckpt_scheduler: a ZeRO-2 job with DeepSpeed's ``WarmupDecayLR`` (``build_pieces``) trains 3 steps
at world 2, saves ``pieces.stateful(model)`` and trains 3 more; a world-1 job built from the same config loads the
checkpoint and trains 3 steps. Each writes the learning rate of every step it took (``OUT.rank<r>``, ckpt_fork.py);
the driver writes ``OUT.summary``: the world-2 run's 6 and the world-1 run's 3."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from ckpt_fork import fork_world, join
from tiny_net import GLOBAL_BATCH, Net, batch, loss_of

from elasticzero.checkpoint import Checkpointer
from elasticzero.config.build import EnginePieces, build_pieces

SCHEDULE = {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
                                                "warmup_num_steps": 10}}  # fmt: skip
CONFIG = {"zero": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}}, "scheduler": SCHEDULE}


def train(pieces: EnginePieces, model: Net, steps: range) -> list[float]:
    """The learning rate of each step; every rank takes its slice of the global batch."""
    n, r = dist.get_world_size(), dist.get_rank()
    per, lrs = GLOBAL_BATCH // n, []
    for step in steps:
        lrs.append(pieces.optimizer.param_groups[0]["lr"])
        x, y = batch(step)
        pieces.backward(loss_of(model, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]))
        assert not pieces.step().skipped
    return lrs


def saving(directory: str) -> list[float]:
    model = Net()
    pieces = build_pieces(model, CONFIG)
    lrs = train(pieces, model, range(3))
    with Checkpointer(directory, keep_last=1) as ckpt:
        ckpt.save(3, pieces.stateful(model))
    return lrs + train(pieces, model, range(3, 6))


def loading(directory: str) -> list[float]:
    model = Net()
    pieces = build_pieces(model, CONFIG)
    with Checkpointer(directory, read_only=True) as ckpt:
        assert ckpt.load_latest(pieces.stateful(model)) == 3
    assert pieces.scheduler is not None and pieces.scheduler.last_batch_iteration == 2
    return train(pieces, model, range(3, 6))


def main(out: Path) -> dict[str, Any]:
    directory = f"{out}.d"
    two = join(fork_world(2, saving, out, directory), out)
    one = join(fork_world(1, loading, out, directory), out)
    return {"world2": two, "world1": one}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(sys.argv[1])
    Path(f"{out}.summary").write_text(json.dumps(main(out)))
