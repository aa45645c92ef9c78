"""Worker of the Lightning strategy test, run by ``elasticzero-run``: a tiny Llama (``hf_worker.build``, built from a
config) in a ``LightningModule``, trained by several ``Trainer.fit`` runs in sequence in one process (a launched job
costs seconds of imports, a fit of this model less than one).

``world2 OUT``: Lightning's own ``strategy="ddp"`` in float64 (``precision="64-true"``: the truth) and in fp32 (the
reference), then ``ElasticZeroStrategy`` at stages 1, 2 (native configs) and 3 (a DeepSpeed config with ``"auto"``),
each saving a sharded checkpoint at the end of epoch 0 (step 2, at the batch's end: Lightning resumes from there
cleanly, a plain DataLoader cannot resume mid-epoch). ``world1 OUT``: each stage's checkpoint resumed on one rank at
another stage (1→2, 2→3, 3→1) for the remaining steps, and a bf16 smoke (``precision="bf16-mixed"``, stage 3, a
validation loop). Every run: accumulation, a clip that bites, the config's
DeepSpeed ``WarmupLR`` (``configure_optimizers`` gives DDP the same schedule).

The data: ``SAMPLES`` fixed sequences, unshuffled. A step of world 2 (2 ranks x ``ACC`` micro-batches of
``PER_RANK``) covers the same contiguous samples as a step of world 1 (``ACC`` micro-batches of ``2 * PER_RANK``), so
its loss — the mean of its micro-batch losses over the ranks — is the same math; and an epoch is as many batches per
rank in both (Lightning resumes at the batch index it saved). Rank 0 writes ``OUT/<mode>.json``: each run's step losses
(and the final fp32 parameters of the uninterrupted runs).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import hf_worker
import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from elasticzero.engine.lr_schedules import build_schedule
from elasticzero.integrations.lightning import ElasticZeroStrategy

PER_RANK, ACC, STEPS, EPOCH_STEPS = 2, 2, 4, 2
SAMPLES = 2 * PER_RANK * ACC * EPOCH_STEPS  # one epoch: EPOCH_STEPS optimizer steps at world 2
LR, WD, MAX_NORM = hf_worker.LR, hf_worker.WD, hf_worker.MAX_NORM
SCHEDULE = {"warmup_min_lr": LR / 10, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}
RESUME_AT = {1: 2, 2: 3, 3: 1}  # world 1 resumes stage s's checkpoint at stage RESUME_AT[s]


class TinyLM(L.LightningModule):
    """A tiny Llama; records every micro-batch's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = hf_worker.build("llama")
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(input_ids=batch).logits  # the loss in the model's dtype (HF's own upcasts to fp32)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        self.losses.append(loss.detach().double().item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:  # run by the bf16 smoke only
        logits = self.net(input_ids=batch).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:  # what Lightning's DDP runs; ElasticZeroStrategy uses the config's
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": build_schedule(opt, "WarmupLR", SCHEDULE), "interval": "step"},
        }


def data(batch: int) -> DataLoader[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, hf_worker.VOCAB, (SAMPLES, hf_worker.SEQ), generator=g)
    return DataLoader(list(tokens), batch_size=batch, shuffle=False)


def native(stage: int) -> dict[str, Any]:
    return {
        "zero": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {"type": "WarmupLR", "params": SCHEDULE},
    }  # accumulation and clipping left out: the Trainer's


def deepspeed(stage: int) -> dict[str, Any]:
    """A DeepSpeed config as HF's docs write them: the Trainer's values left to "auto"."""
    return {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {"type": "WarmupLR", "params": SCHEDULE},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": PER_RANK,
        "bf16": {"enabled": "auto"},
    }


def fit(
    strategy: Any,
    batch: int,
    *,
    precision: str = "32-true",
    ckpt_dir: Path | None = None,
    resume: Path | None = None,
    validate: bool = False,
) -> TinyLM:
    world = int(os.environ["WORLD_SIZE"])
    module = TinyLM()
    callbacks = (
        [] if ckpt_dir is None else [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=EPOCH_STEPS, save_top_k=-1)]
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_steps=STEPS,
        accumulate_grad_batches=ACC, gradient_clip_val=MAX_NORM, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
        num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    val = data(batch) if validate else None
    trainer.fit(module, data(batch), val, ckpt_path=None if resume is None else str(resume))
    return module


def step_losses(module: TinyLM, micro_per_step: int) -> list[float]:
    """Each optimizer step's loss: the mean of its micro-batches' over every rank."""
    every: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, module.losses)
    mine = [[sum(r[i : i + micro_per_step]) / micro_per_step for i in range(0, len(r), micro_per_step)] for r in every]
    return [sum(col) / len(col) for col in zip(*mine, strict=True)]


def params(module: TinyLM, strategy: Any) -> dict[str, list[float]]:
    if isinstance(strategy, ElasticZeroStrategy):
        full = strategy.pieces.optimizer.full_state_dict()  # type: ignore[attr-defined]
        state = {k.removeprefix("module.net."): v for k, v in full.items()}
    else:
        state = {k: v.detach() for k, v in module.net.named_parameters()}
    return {k: state[k].double().reshape(-1).tolist() for k, _ in module.net.named_parameters()}


def world2(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, precision in (("ddp64", "64-true"), ("ddp32", "32-true")):
        module = fit("ddp", PER_RANK, precision=precision)
        report[name] = {"losses": step_losses(module, ACC), "params": params(module, None)}
    for stage in (1, 2, 3):
        config = deepspeed(stage) if stage == 3 else native(stage)
        strategy = ElasticZeroStrategy(config)
        module = fit(strategy, PER_RANK, ckpt_dir=out / f"ckpt{stage}")
        report[f"stage{stage}"] = {"losses": step_losses(module, ACC), "params": params(module, strategy)}
    return report


def world1(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for stage, at in RESUME_AT.items():
        ckpt = out / f"ckpt{stage}" / f"epoch=0-step={EPOCH_STEPS}.ckpt"
        module = fit(ElasticZeroStrategy(native(at)), 2 * PER_RANK, resume=ckpt)
        report[f"resume{stage}"] = {"losses": step_losses(module, ACC)}
    strategy = ElasticZeroStrategy(native(3))  # a smoke: Lightning's bf16 flag, a validation loop through the root
    module = fit(strategy, 2 * PER_RANK, precision="bf16-mixed", validate=True)
    dtype = str(strategy.pieces.precision.param_dtype)
    val = module.trainer.callback_metrics["val_loss"].item()
    report["bf16"] = {"losses": step_losses(module, ACC), "param_dtype": dtype, "val_loss": val}
    return report


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    report = world2(out) if mode == "world2" else world1(out)
    if dist.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
