"""``checkpoint_activations`` under ``torch.compile`` (Inductor) with the ZeRO stages, world 1 in-process (gloo):
stage 3 with every block compiled after wrapping (torchtitan's pattern; stage 3's unit hooks run between the blocks'
graphs) and stage 1 with the whole model compiled. Asserted per scenario:

- compiled, checkpointed training equals eager training without checkpointing: ``ez_numerics.error_ratio`` against
  plain AdamW in float64 <= 1 (Inductor fuses, so it rounds differently, not more);
- Dynamo compiled frames in the warm-up steps and none after them, which run under
  ``torch.compiler.set_stance("fail_on_recompile")`` (a recompile raises, naming its guard).

Inductor's first compile on a loaded 2-core machine takes minutes (g++ per graph); its on-disk cache serves reruns.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

from elasticzero import ZeroStage1, ZeroStage3
from elasticzero.engine import checkpoint_activations
from ez_numerics import error_ratio
from ez_testing import free_port, require

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from gpt import GPT, config_for, lm_loss, synthetic_batch

CFG = config_for("tiny")
STEPS, WARMUP, LR = 4, 2, 1e-3
pytestmark = [pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    require(shutil.which(os.environ.get("CXX", "g++")) is not None, "Inductor needs a C++ compiler (g++)")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [synthetic_batch(CFG, 4, 32, gen) for _ in range(STEPS)]


def _model(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).to(dtype)


def _train(stage: type, mode: str | None) -> tuple[dict[str, torch.Tensor], int, int]:
    """Masters after STEPS steps; frames Dynamo compiled in the warm-up and after it. ``mode``: None = eager without
    checkpointing; "block" / "whole" = checkpointed and compiled that way."""
    model = _model()
    if mode:
        checkpoint_activations(model)
    opt = stage(model, torch.optim.AdamW, lr=LR)
    net: nn.Module = torch.compile(model) if mode == "whole" else model
    if mode == "block":
        for block in model.blocks:
            block.compile()
    frames = [int(counters["frames"]["total"])]
    for step, (x, y) in enumerate(_batches()):
        if step == WARMUP:
            frames.append(int(counters["frames"]["total"]))
        with torch.compiler.set_stance("fail_on_recompile" if step >= WARMUP else "default"):
            lm_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    frames.append(int(counters["frames"]["total"]))
    return opt.full_state_dict(), frames[1] - frames[0], frames[2] - frames[1]


def _truth() -> dict[str, torch.Tensor]:
    model = _model(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in _batches():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("stage", "mode"), [(ZeroStage3, "block"), (ZeroStage1, "whole")], ids=["s3_block", "s1_whole"]
)
def test_compiled_checkpointed_training_equals_eager_and_compiles_once(world1: None, stage: type, mode: str) -> None:
    torch.compiler.reset()
    eager, _, _ = _train(stage, None)
    compiled, warmup_frames, after_frames = _train(stage, mode)
    assert error_ratio(compiled, eager, _truth()) <= 1.0
    assert warmup_frames >= 1 and after_frames == 0, (warmup_frames, after_frames)
