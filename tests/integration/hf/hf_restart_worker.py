"""Worker of the HF ``Trainer`` restart test, started by two ``elasticzero-run --nnodes 1:2`` agents:
``hf_restart_worker.py OUT``.

The script a user writes (docs/integrations-hf.md): a ``ZeroTrainer`` at stage 2 (the tiny Llama and the fixed tokens
of ``hf_door_worker``, 4 steps, a checkpoint every 2) that trains with
``resume_from_checkpoint=last_checkpoint(OUT) or None``; the global batch kept at every world size (accumulation
``2 // world``). What the test adds, by one callback: every start, step and logged loss appended to
``OUT/events.<pid>.jsonl``; a world of 1 waits while ``OUT/gate`` exists (the first agent may start alone before the
second joins; a world of 2 removes the gate); a world of 2 holds after its save at step 2 in a barrier loop (the
test takes a node away there: the barrier fails on the survivor, whose agent restarts it at world 1). The run that
reaches step 4 then trains the uninterrupted reference in the same process: the plain ``Trainer`` in fp32 and in
float64 (the ``ez_numerics`` truth) at world 1, and writes the three final models to ``OUT/params.pt`` and
``OUT/report.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import hf_worker
import torch
import torch.distributed as dist
from hf_door_worker import STEPS, Tokens, arguments, losses
from transformers import Trainer, TrainerCallback

from elasticzero.integrations.hf import ZeroTrainer, ZeroTrainingArguments, last_checkpoint

SAVE, HOLD_S = 2, 300.0


class Events(TrainerCallback):
    """Appends this process's start, steps and losses to its own file; holds a world of 2 after the save at step 2."""

    def __init__(self, out: Path, resume: str | None) -> None:
        self.out, self.resume = out, resume
        self.world, self.rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        self.path = out / f"events.{os.getpid()}.jsonl"

    def write(self, event: str, **kw: Any) -> None:
        line = {"event": event, "world": self.world, "rank": self.rank, "time": time.time(), **kw}
        with self.path.open("a") as fh:
            fh.write(json.dumps(line) + "\n")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write("begin", step=state.global_step, resume=self.resume)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write("step", step=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.write("loss", step=state.global_step, loss=float(logs["loss"]))

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.world == 2 and state.global_step == SAVE:
            self.write("held", step=state.global_step)
            hold()


def hold() -> None:
    """Barriers until a peer is lost (the barrier raises, the agent restarts this worker) or ``HOLD_S`` pass."""
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        dist.barrier()
        time.sleep(0.2)
    raise RuntimeError(f"held {HOLD_S:.0f} s at step {SAVE} and no node was lost")


def gate(out: Path, world: int) -> None:
    """A world of 1 waits for the gate to go (its agent restarts it when the second node joins); 2 removes it."""
    if world == 2:
        (out / "gate").unlink(missing_ok=True)
    deadline = time.monotonic() + HOLD_S
    while world == 1 and (out / "gate").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the second node never joined")
        time.sleep(0.2)


def elastic_run(out: Path) -> ZeroTrainer:
    """The user's script: the newest checkpoint resumed, if any, with the global batch of 4 kept."""
    world = int(os.environ["WORLD_SIZE"])
    resume = last_checkpoint(out / "run")
    extra = {"gradient_accumulation_steps": 2 // world, "save_strategy": "steps", "save_steps": SAVE}
    args = arguments(out / "run", ZeroTrainingArguments, **extra)
    trainer = ZeroTrainer(
        model=hf_worker.build("llama"),
        args=args,
        train_dataset=Tokens(64),
        zero_config={"zero": {"stage": 2}},
        callbacks=[Events(out, resume)],
    )
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def reference(out: Path, dtype: torch.dtype) -> Trainer:
    """The uninterrupted run at world 1 (2 micro-batches of 2 a step: the same global batches), the plain Trainer."""
    args = arguments(out / f"ref-{dtype}".replace("torch.", ""), gradient_accumulation_steps=2)
    trainer = Trainer(model=hf_worker.build("llama").to(dtype), args=args, train_dataset=Tokens(64))
    trainer.train()
    return trainer


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    assert trainer.model is not None
    return {k: v.detach().double().clone() for k, v in trainer.model.state_dict().items()}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    gate(out, int(os.environ["WORLD_SIZE"]))
    trainer = elastic_run(out)
    ref, truth = reference(out, torch.float32), reference(out, torch.float64)
    torch.save({"elastic": state(trainer), "ref": state(ref), "truth": state(truth)}, out / "params.pt")
    report = {"ref_losses": losses(ref), "truth_losses": losses(truth), "last_checkpoint": last_checkpoint(out / "run")}
    (out / "report.json").write_text(json.dumps(report))
    assert trainer.state.global_step == STEPS


if __name__ == "__main__":
    main()
