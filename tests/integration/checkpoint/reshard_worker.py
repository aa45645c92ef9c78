"""Driver for test_ckpt_reshard: forks a world of 3 ranks (ckpt_fork.py). For every case (stage, precision,
N -> stage', M), ranks [0, N) train two steps and save; ranks [0, M) build a fresh optimizer (other seed), load the
newest checkpoint, compare the fp32 masters and Adam moments bitwise with the saved full values, train two more steps
and compare the parameters with the uninterrupted run and a float64 truth (ez_numerics).
Each rank writes ``{case: [problems]}`` to ``OUT.rank<r>``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_fork import fork_world, join, run_cases
from ckpt_model import PlainState, build, continue_plainly, full_state, mismatches, train

from elasticzero.checkpoint import Checkpointer
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from ez_numerics import error_ratio

CASES = [(s, p, n, s, m) for s in (1, 2, 3) for p in ("fp32", "bf16") for n, m in ((2, 1), (1, 2), (2, 3), (3, 2))] + [
    (2, "fp32", 2, 3, 3),
    (3, "bf16", 3, 1, 1),
    (2, "fp32", 2, 3, 2),
    (3, "fp32", 2, 1, 2),
    (2, "fp16", 2, 3, 3),
]


def run_case(case: tuple[Any, ...], groups: dict[int, Any], root: Path) -> list[str]:
    s, prec, n, t, m = case
    rank, problems = dist.get_rank(), []
    directory = root / "_".join(map(str, case))
    box: list[Any] = [None]
    if rank < n:
        opt = build(s, prec, groups[n], seed=1)
        train(opt, range(0, 2))
        ckpt = Checkpointer(directory, keep_last=1, process_group=groups[n])
        ckpt.save(2, {"zero": ZeroCheckpointState(opt), "extra": {"tokens": 12}})
        saved = full_state(opt)
        train(opt, range(2, 4))
        box = [(saved, opt.full_state_dict())]
    dist.broadcast_object_list(box, src=0)
    saved, uninterrupted = box[0]
    if rank < m:
        opt = build(t, prec, groups[m], seed=2)
        extra = {"tokens": 0}
        step = Checkpointer(directory, process_group=groups[m], read_only=True).load_latest(
            {"zero": ZeroCheckpointState(opt), "extra": extra}
        )
        if step != 2 or extra != {"tokens": 12}:
            problems.append(f"loaded step {step}, extra {extra}")
        problems += [f"not bit-exact after load: {k}" for k in mismatches(opt, saved)]
        train(opt, range(2, 4))
        problems += continuation_problems(opt.full_state_dict(), saved, uninterrupted)
    return problems


def continuation_problems(
    got: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], uninterrupted: dict[str, torch.Tensor]
) -> list[str]:
    """Another world size or stage sums the gradient reductions in another order (and bf16/fp16 slices round
    differently): the resumed run may be off the float64 truth (plain torch from the saved state) by what rounding
    moved the uninterrupted run, a run in the same precision (ez_numerics)."""
    calls = int(uninterrupted["calls"].item()) - 2  # the buffer at the save (it counts the forward passes)
    truth = continue_plainly(PlainState.of(saved), uninterrupted["frozen.weight"], calls, range(2, 4), 1, "fp64")
    ratio = error_ratio({k: got[k] for k in truth}, {k: uninterrupted[k] for k in truth}, truth)
    return [] if ratio <= 1 else [f"resumed state off by {ratio:.3g}x the rounding scale of its precision"]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = sys.argv[1]
    join(fork_world(3, run_cases, Path(out), out, CASES, run_case), Path(out))
