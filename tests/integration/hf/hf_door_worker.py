"""Worker of the HF ``Trainer`` front door test, run by ``elasticzero-run``: ``hf_door_worker.py OUT PHASE``.

``PHASE=train`` (2 ranks): the same ``Trainer`` job (tiny Llama from ``hf_worker.build``, nothing downloaded, a
fixed token set in order, 4 steps, AdamW, clipping, a linear schedule) run as plain DDP in fp32 and in float64 (the
truth of ``ez_numerics``), then under ``ZeroTrainer`` at stages 1 (micro-batches of 1, 2 accumulated), 2, 3 from a
native config; the stage-2 run saves ``checkpoint-2`` and ``checkpoint-4``; the stage-3 model is exported with
``save_model`` and reloaded with ``from_pretrained``; the DDP and stage-3 models evaluated; last, the HF docs'
``ds_config`` with ``"auto"`` values (``examples/configs/ds_zero2_hf.json``) trains 2 steps. ``PHASE=resume`` (1 rank):
``ZeroTrainer`` at stage 3 resumes from the stage-2 ``checkpoint-2`` and trains steps 3 and 4 (the global batch kept:
2 micro-batches of 2). Each rank writes ``OUT/report.<phase>.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hf_worker
import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from elasticzero.integrations.hf import ZeroTrainer, ZeroTrainingArguments, last_checkpoint

STEPS, MICRO, SEQ = 4, 2, 8
REPO = Path(__file__).resolve().parents[3]


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` fixed random sequences (the same on every rank and run), their own labels."""

    def __init__(self, n: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, hf_worker.VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: Path, cls: type[TrainingArguments] = TrainingArguments, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": MICRO,
        "max_steps": STEPS,
        "learning_rate": 1e-3,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,  # below the tiny model's gradient norm: every step clips
        "lr_scheduler_type": "linear",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
        "ddp_backend": "gloo",
        "seed": 0,
        "train_sampling_strategy": "sequential",
        "dataloader_num_workers": 0,
    }
    return cls(**{**base, **kw})


def losses(trainer: Trainer) -> list[float]:
    return [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]


def norms(trainer: Trainer) -> list[float]:
    return [float(e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]


def ddp_run(out: Path, dtype: torch.dtype) -> Trainer:
    trainer = Trainer(model=hf_worker.build("llama").to(dtype), args=arguments(out), train_dataset=Tokens(64))
    trainer.train()
    return trainer


def eval_loss(trainer: Trainer) -> float:
    """The trained model's loss on 8 other sequences, gathered over the ranks (the ``Trainer``'s ``evaluate``)."""
    return float(trainer.evaluate(Tokens(8, seed=8))["eval_loss"])


def zero_run(out: Path, stage: int, **kw: Any) -> ZeroTrainer:
    args = arguments(out, ZeroTrainingArguments, **kw)
    trainer = ZeroTrainer(
        model=hf_worker.build("llama"), args=args, train_dataset=Tokens(64), zero_config={"zero": {"stage": stage}}
    )
    trainer.train()
    return trainer


def check_export(trainer: ZeroTrainer, out: Path, rank: int) -> dict[str, Any]:
    """``save_model`` (collective, stage 3 gathered), then ``from_pretrained`` gives the engine model's logits."""
    trainer.save_model(str(out))
    ids = Tokens(64).ids[:2]
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits  # every rank: stage 3's forward gathers
    dist.barrier()
    if rank != 0:
        return {}
    loaded = type(trainer.model).from_pretrained(str(out)).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    return {
        "export_logits_equal": bool(torch.equal(got, want)),
        "export_logits_maxdiff": (got - want).abs().max().item(),
        "export_logits_scale": want.abs().max().item(),
        "export_dtype": str(next(loaded.parameters()).dtype),
    }


def train_phase(out: Path, rank: int, record: dict[str, Any]) -> None:
    for name, dtype in (("ddp", torch.float32), ("truth", torch.float64)):
        trainer = ddp_run(out / name, dtype)
        record[f"{name}_losses"], record[f"{name}_norms"] = losses(trainer), norms(trainer)
        record[f"{name}_eval"] = eval_loss(trainer)
    for stage in (1, 2, 3):
        # stage 1 in micro-batches of 1 over 2 accumulation steps (the same 4 samples a step: the engine's no_sync),
        # stage 2 saves checkpoint-2 and checkpoint-4
        extra = {1: {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}}
        extra[2] = {"save_strategy": "steps", "save_steps": 2}
        trainer = zero_run(out / f"s{stage}", stage, **extra.get(stage, {}))
        record[f"s{stage}_losses"], record[f"s{stage}_norms"] = losses(trainer), norms(trainer)
        record[f"s{stage}_stage"] = type(trainer.engine.optimizer).__name__ if trainer.engine else None
        record[f"s{stage}_ddp_wrapped"] = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        if stage == 2:
            record["s2_last_checkpoint"] = last_checkpoint(out / "s2")
        if stage == 3:
            record["s3_eval"] = eval_loss(trainer)  # every rank's forward gathers the stage-3 units
            record.update(check_export(trainer, out / "export", rank))
    ds = ZeroTrainer(
        model=hf_worker.build("llama"),
        args=arguments(
            out / "ds", ZeroTrainingArguments, max_steps=2, zero_config=str(REPO / "examples/configs/ds_zero2_hf.json")
        ),
        train_dataset=Tokens(64),
    )
    ds.train()
    assert ds.engine is not None
    cfg = ds.engine.config
    record["ds_losses"] = losses(ds)
    record["ds_filled"] = {
        "stage": cfg.zero.stage,
        "lr": cfg.optimizer.params["lr"],
        "betas": list(cfg.optimizer.params["betas"]),
        "weight_decay": cfg.optimizer.params["weight_decay"],
        "clip": cfg.clip_grad_norm,
        "train_batch_size": cfg.train_batch_size,
        "micro": cfg.micro_batch_size,
        "scheduler": cfg.scheduler.type,
        "warmup_max_lr": cfg.scheduler.params.get("warmup_max_lr"),
        "offload": cfg.zero.offload.optimizer,
    }


def resume_phase(out: Path, rank: int, record: dict[str, Any]) -> None:
    args = arguments(out / "resumed", ZeroTrainingArguments, gradient_accumulation_steps=2)
    trainer = ZeroTrainer(
        model=hf_worker.build("llama"), args=args, train_dataset=Tokens(64), zero_config={"zero": {"stage": 3}}
    )
    trainer.train(resume_from_checkpoint=str(out / "s2" / "checkpoint-2"))
    after = [e for e in trainer.state.log_history if "loss" in e and e["step"] > 2]  # the steps this run trained
    record["resumed_steps"] = [e["step"] for e in after]
    record["resumed_losses"] = [float(e["loss"]) for e in after]
    record["resumed_norms"] = [float(e["grad_norm"]) for e in after]
    record["resumed_world"] = dist.get_world_size()


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    record: dict[str, Any] = {}
    start = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    try:
        (train_phase if phase == "train" else resume_phase)(out, rank, record)
    except Exception:
        record["error"] = traceback.format_exc()
        raise
    finally:
        record["seconds"] = time.perf_counter() - start  # information only
        Path(out, f"report.{phase}.rank{rank}.json").write_text(json.dumps(record, default=str))


if __name__ == "__main__":
    main()
