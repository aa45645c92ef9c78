"""Driver for test_copies_overlap: ``copies_overlap_worker.py OUT`` forks a world of 2 gloo ranks per case (torch
imported once, in the driver), each its own node (each holds the other's copy), and writes ``[problems]`` per rank to
``OUT.<case>.rank<r>``.

Every case trains :data:`STEPS` steps through the engine's own step path (:func:`optimizer_step`: a loss scaler's
unscale, a global-norm clip that bites, the step, ``zero_grad``), one of them skipped for an inf in the loss, with a
:class:`BuddyCopies` whose gradients go to the holder during backward. Small buckets, so a step has several. Then every
holder's copy must equal its ward's live state bitwise, and the gradients must have gone the way
:func:`early_grads_usable` says: during backward with one backward per step and with accumulation under ``no_sync``
(one reduction), at the pre-step hook with accumulation by repeated backward (each bucket reduced twice).

Cases (stage, precision, accumulation): ``once`` one backward per step; ``nosync`` two micro-batches, the first under
``opt.no_sync()``; ``repeat`` two micro-batches, both reduced; ``offload`` one backward, under ZeRO-Offload's host
path (``cpu_copies``: host masters and gradients, the per-bucket host step); ``offparams`` the same with the stage-3
parameter shards in host memory too.

``copies_overlap_worker.py OUT MODE...`` runs only the cases of those modes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))  # the checkpoint tests' model
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # live_reshard_worker

import torch
import torch.distributed as dist
from ckpt_model import STAGES, full_state
from live_reshard_worker import copies_problems
from tiny_net import GLOBAL_BATCH, LR, WD, Net, batch, loss_of

from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.engine.step import optimizer_step
from elasticzero.engine.zero.offload import OffloadOptions
from elasticzero.live.copies import BuddyCopies
from ez_testing import free_port

STEPS, SKIP = 4, 1  # steps trained; the one whose loss is made inf (every rank skips it)
CLIP = 0.05  # below the tiny net's gradient norm: the clip coefficient is < 1 on every step taken
BUCKET_BYTES = 256  # several buckets at stages 1/2 (stage 3: one per unit)
CASES = [
    (1, "fp32", "once"),
    (2, "fp32", "once"),
    (3, "fp32", "once"),
    (1, "bf16", "once"),
    (2, "bf16", "once"),
    (3, "bf16", "once"),
    (2, "fp16", "once"),
    (2, "fp32", "nosync"),
    (1, "bf16", "nosync"),
    (2, "fp32", "repeat"),
    (3, "bf16", "repeat"),
    (1, "fp32", "offload"),
    (2, "bf16", "offload"),
    (3, "fp32", "offparams"),
]
OFFLOAD = {  # the host path on a CPU device (separate host buffers, per-bucket host steps): what a GPU run does
    "offload": OffloadOptions(optimizer=True, cpu_copies=True),
    "offparams": OffloadOptions(optimizer=True, params=True, cpu_copies=True),
}


def micro_batches(step: int, rank: int, mode: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's half of the step's global batch, in one micro-batch or two."""
    x, y = batch(step)
    per = GLOBAL_BATCH // 2
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    if mode not in ("nosync", "repeat"):
        return [(x, y)]
    return [(x[: per // 2], y[: per // 2]), (x[per // 2 :], y[per // 2 :])]


def backward(opt: Any, scaler: LossScaler, step: int, mode: str) -> None:
    micro = micro_batches(step, opt.rank, mode)
    for i, (x, y) in enumerate(micro):
        deferred = mode == "nosync" and i < len(micro) - 1
        with opt.no_sync() if deferred else contextlib.nullcontext():
            loss = loss_of(opt.module, x, y) / len(micro)
            if step == SKIP:
                loss = loss * float("inf")
            scaler.scale(loss).backward()


def run(case: tuple[Any, ...]) -> list[str]:
    s, prec, mode = case
    torch.manual_seed(1)
    opt = STAGES[s](
        Net(),
        torch.optim.AdamW,
        lr=LR,
        weight_decay=WD,
        precision=prec,
        bucket_bytes=BUCKET_BYTES,
        offload=OFFLOAD.get(mode),
    )
    rep = BuddyCopies(opt, nodes=[0, 1])
    scaler = LossScaler(2.0**10)
    results = []
    for step in range(STEPS):
        backward(opt, scaler, step, mode)
        results.append(optimizer_step(opt, scaler=scaler, max_norm=CLIP))
    problems = copies_problems(rep, full_state(opt))
    taken = [r for r in results if not r.skipped]
    want_early = len(taken) if mode != "repeat" else 0
    if [r.skipped for r in results] != [i == SKIP for i in range(STEPS)]:
        problems.append(f"skipped steps {[r.skipped for r in results]}, want only step {SKIP}")
    if not all(r.grad_norm is not None and r.grad_norm.item() > CLIP for r in taken):
        problems.append("the clip did not bite on every step taken")
    if rep.early_steps != want_early or rep.census() != {0: len(taken), 1: len(taken)}:
        problems.append(f"early steps {rep.early_steps} (want {want_early}), census {rep.census()}")
    if len(opt.buckets) < 2:
        problems.append(f"{len(opt.buckets)} bucket(s): the case needs several")
    rep.close()
    return problems


def child(case: tuple[Any, ...], rank: int, port: str, out: Path) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    name = "_".join(map(str, case))
    try:
        dist.init_process_group("gloo")
        Path(f"{out}.{name}.rank{rank}").write_text(json.dumps(run(case)))
        dist.destroy_process_group()
        return 0
    except BaseException:
        Path(f"{out}.{name}.err{rank}").write_text(traceback.format_exc())
        return 1


def run_case(case: tuple[Any, ...], out: Path) -> None:
    port, pids = str(free_port()), []
    for r in range(2):
        pid = os.fork()
        if pid == 0:
            os._exit(child(case, r, port, out))
        pids.append(pid)
    for r, pid in enumerate(pids):
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            err = Path(f"{out}.{'_'.join(map(str, case))}.err{r}")
            raise RuntimeError(f"{case} rank {r} exited {code}: {err.read_text() if err.exists() else ''}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for c in CASES:
        if len(sys.argv) < 3 or c[2] in sys.argv[2:]:
            run_case(c, Path(sys.argv[1]))
