"""Worker side of the accelerate front door's tests: one ``Accelerator`` training loop (accumulation, clipping through
``accelerator.clip_grad_norm_``, a warm-up ``LambdaLR`` prepared with the optimizer) on a tiny Llama built from a
config, run with a plain ``Accelerator`` (DDP, the reference: fp32, and float64 as the truth) and with
``ZeroAccelerator`` on ZeRO stages 1, 2 and 3, all in one launched job.

Modes (the first argument; the second is the output directory, shared by the jobs):

- ``compare`` (2 ranks): the DDP references and stages 1-3 for :data:`STEPS` steps; each stage saves with
  ``accelerator.save_state`` after step :data:`SAVE_AT`.
- ``resume`` (1 rank): each stage's checkpoint loaded at world 1 into the next stage (1 → 2 → 3 → 1), trained to the
  end with the same global batches (one rank accumulating all micro-batches).
- ``launch`` (2 ranks, under ``accelerate launch``): stage 2 with a loss scaler whose first step overflows
  (``step_was_skipped``, the schedule not stepped, the parameters untouched), then a step taken.

Every rank writes ``{mode}.rank<r>.json``; the test compares the runs with ``ez_numerics``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from hf_worker import build, make_batch

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.integrations.accelerate import ZeroAccelerator
from ez_numerics import error_ratio

STEPS, SAVE_AT, MICRO, LR, WD, MAX_NORM = 3, 1, 4, 1e-3, 0.01, 0.5  # MICRO: micro-batches per global batch
STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def accelerator_kwargs(world: int) -> dict[str, Any]:
    """The same for every run: the CPU (accelerate needs to be told), the global batch of MICRO micro-batches, and
    one schedule step per optimizer step at any world size (split_batches)."""
    return {
        "cpu": not torch.cuda.is_available(),
        "gradient_accumulation_steps": MICRO // world,
        "dataloader_config": DataLoaderConfiguration(split_batches=True),
    }


def warmup(opt: Any) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / STEPS))


def train(acc: Accelerator, model: Any, opt: Any, sched: Any, start: int, stop: int, **save: Any) -> dict[str, Any]:
    """The user's loop, identical for every run: ``stop - start`` optimizer steps of this rank's micro-batches."""
    rank, world, accum = acc.process_index, acc.num_processes, acc.gradient_accumulation_steps
    losses, norms, skipped, saved = [], [], [], None
    for step in range(start, stop):
        total = torch.zeros((), dtype=torch.float64)
        for k in range(accum):
            with acc.accumulate(model):
                loss = model(**make_batch("llama", step, rank * accum + k)).loss
                acc.backward(loss)
                total += loss.detach().double() / accum
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
                opt.step()
                sched.step()
                opt.zero_grad()
        skipped.append(bool(opt.step_was_skipped))
        losses.append(acc.reduce(total, "mean").item())
        if step + 1 == save.get("at"):
            saved = acc.save_state(save["to"])
    assert world * accum == MICRO
    return {"losses": losses, "norms": norms, "skipped": skipped, "lr": sched.get_last_lr()[0], "saved": saved}


def ddp_run(dtype: torch.dtype, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The reference: the loop with a plain Accelerator (DDP); its record and its trained parameters."""
    acc = Accelerator(**accelerator_kwargs(world))
    model = build("llama").to(dtype).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt, sched = acc.prepare(model, opt, warmup(opt))
    out = train(acc, model, opt, sched, 0, STEPS)
    out["ddp_wrapped"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    return out, {k: p.detach() for k, p in acc.unwrap_model(model).named_parameters()}


def zero_run(stage: int, world: int, out_dir: Path) -> tuple[ZeroAccelerator, Any, dict[str, Any]]:
    """The loop with ZeroAccelerator on a ZeRO stage, saving after step SAVE_AT; the accelerator, the prepared model
    and the record."""
    acc = ZeroAccelerator(**accelerator_kwargs(world))
    model = build("llama").eval()
    opt = STAGES[stage](model, torch.optim.AdamW, lr=LR, weight_decay=WD)
    model, opt, sched = acc.prepare(model, opt, warmup(opt))
    out = train(acc, model, opt, sched, 0, STEPS, at=SAVE_AT, to=out_dir / f"ckpt_s{stage}")
    out["ddp_wrapped"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    return acc, model, out


def saved_model_equal(acc: ZeroAccelerator, model: Any, directory: Path) -> bool:
    """``accelerator.save_model`` writes the full model gathered from the masters (stage 3: not the freed storage)."""
    from safetensors.torch import load_file

    full = acc.get_state_dict(model)
    acc.save_model(model, directory)
    acc.wait_for_everyone()
    written = load_file(directory / "model.safetensors")
    return sorted(written) == sorted(full) and all(torch.equal(written[k], full[k]) for k in full)


def resume_run(saved: int, world: int, out_dir: Path) -> dict[str, Any]:
    stage = saved % 3 + 1  # another stage than the one that saved
    acc = ZeroAccelerator(**accelerator_kwargs(world))
    model = build("llama").eval()
    opt = STAGES[stage](model, torch.optim.AdamW, lr=LR, weight_decay=WD)
    model, opt, sched = acc.prepare(model, opt, warmup(opt))
    acc.load_state(str(out_dir / f"ckpt_s{saved}"))
    out = {"steps_loaded": opt.steps, "stage": stage}
    out.update(train(acc, model, opt, sched, SAVE_AT, STEPS))
    acc.close_checkpoints()
    return out


def overflow_run(world: int) -> dict[str, Any]:
    """A scale so large that step 0's gradients overflow: that step is skipped everywhere, the scale backed off."""
    scaler = LossScaler(2.0**126, hysteresis=1, backoff_factor=2.0**-100)
    acc = ZeroAccelerator(**accelerator_kwargs(world), loss_scaler=scaler)
    model = build("llama").eval()
    opt = ZeroStage2(model, torch.optim.AdamW, lr=LR, weight_decay=WD)
    before = {k: v.clone() for k, v in opt.full_state_dict().items()}
    model, opt, sched = acc.prepare(model, opt, warmup(opt))
    out = train(acc, model, opt, sched, 0, 1)
    after = opt.optimizer.full_state_dict()
    out["unchanged_after_skip"] = all(torch.equal(before[k], after[k]) for k in before)
    out["sched_epoch"] = sched.scheduler.last_epoch
    out["scale"] = scaler.get_scale()
    out.update({f"next_{k}": v for k, v in train(acc, model, opt, sched, 1, 2).items()})
    out["sched_epoch_next"] = sched.scheduler.last_epoch
    return out


def run(mode: str, out_dir: Path, record: dict[str, Any]) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if mode == "compare":
        record["ddp32"], ref = ddp_run(torch.float32, world)
        record["ddp64"], truth = ddp_run(torch.float64, world)
        for stage in STAGES:
            acc, model, record[f"s{stage}"] = zero_run(stage, world, out_dir)
            record[f"s{stage}"]["params_ratio"] = error_ratio(acc.get_state_dict(model), ref, truth)
            if stage == 3:
                record["s3"]["saved_model_equal"] = saved_model_equal(acc, model, out_dir / "model_s3")
            acc.close_checkpoints()
    elif mode == "resume":
        for saved in STAGES:
            record[f"s{saved}"] = resume_run(saved, world, out_dir)
    else:
        record["run_id"] = os.environ.get("TORCHELASTIC_RUN_ID")
        record["overflow"] = overflow_run(world)
    record["world"] = world
    torch.distributed.destroy_process_group()


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    record: dict[str, Any] = {"import_cpu_s": time.process_time()}  # information only: what the tests cost
    rank = os.environ.get("RANK", "0")
    try:
        start = time.perf_counter()
        run(mode, out_dir, record)
        record["run_s"] = time.perf_counter() - start
    except Exception:
        record["error"] = traceback.format_exc()
        raise
    finally:
        (out_dir / f"{mode}.rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
