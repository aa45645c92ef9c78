"""One gloo rank of the torch.compile tests (``python compile_worker.py OUT``; RANK/WORLD_SIZE/MASTER_* from the
environment, see ``ez_testing.run_ranks``): every scenario of :data:`SCENARIOS` trains a tiny GPT-shaped model under a
ZeRO stage eagerly and compiled (Inductor), and reports per scenario

- ``ratio``: ``ez_numerics.error_ratio(compiled, eager, truth)``, the compiled run's error against plain AdamW in
  float64 on the global batch (the truth), in units of what rounding moved the eager run of the same stage and
  precision (``<= 1``: compiled training is eager training up to rounding of the same kind; see ``ez_numerics``);
- ``warmup_frames``: frames Dynamo compiled in the warm-up steps (> 0: the run did compile);
- ``after_frames``: frames Dynamo compiled after warm-up (recompiles and new frames alike), counted while the steps run
  under ``torch.compiler.set_stance("fail_on_recompile")``; ``recompile_error`` the error that stance raised, if any
  (it names the failed guard);
- ``graphs``: graphs compiled in all, ``compile_s``: wall time of the warm-up (Inductor's cost).

Rank r writes ``OUT.rank{r}`` (JSON).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import elasticzero

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for this worker run as a program
from ez_numerics import error_ratio

VOCAB, DIM, SEQ, PER_RANK, BLOCKS = 32, 16, 8, 2, 2  # a rank's batch is the same at any world size: same graphs
LR, WARMUP, COUNTED = 1e-2, 2, 2
BUCKET_BYTES = 1024  # several buckets on stages 1/2 (a bucket per block and root on stage 3)

# (stage, mode, precision): a covering subset, not all 12 (Inductor's compile time is the cost, see test_compile.py).
# Distinct compiled graphs, not scenarios, cost time: stage 3 compiles the same block graphs in either mode (its root
# frame runs eagerly, see docs/engine.md), so it takes all four of its combinations for the price of the block
# graphs; stages 1/2 run per-block in fp32 and whole-model (one graph of the whole model) in bf16. Three graph sets
# (block fp32, block bf16, whole bf16) cover every pair: each stage in both modes and both precisions, each mode in
# both precisions.
SCENARIOS: list[tuple[int, str, str]] = [
    (1, "block", "fp32"),
    (2, "block", "fp32"),
    (1, "whole", "bf16"),
    (2, "whole", "bf16"),
    (3, "block", "fp32"),
    (3, "block", "bf16"),
    (3, "whole", "fp32"),
    (3, "whole", "bf16"),
]


class Block(nn.Module):
    """An MLP block with a residual (stage 3's default unit: an element of the model's ModuleList)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    """Embedding, ``BLOCKS`` blocks and head (the root owns what is outside the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (``PER_RANK`` rows per rank)."""
    g = torch.Generator().manual_seed(step)
    rows = PER_RANK * dist.get_world_size()
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, VOCAB), y.reshape(-1)
    )


def truth() -> dict[str, torch.Tensor]:
    """Plain AdamW on the global batches in float64."""
    model = make_model().double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(WARMUP + COUNTED):
        x, y = batch(step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def compiled_net(model: Model, mode: str) -> nn.Module:
    """``block``: torchtitan's pattern (each block compiled in place); ``whole``: ``torch.compile(model)``."""
    if mode == "block":
        for block in model.blocks:
            block.compile()
        return model
    return torch.compile(model) if mode == "whole" else model


def frames() -> int:
    """Frames Dynamo compiled so far in this process (first compiles and recompiles alike; torch's own counter: the
    public ``torch.compiler`` API offers the stance that forbids compiling, not a count)."""
    return int(counters["frames"]["total"])


def train(stage: int, mode: str, precision: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train under ``ZeroStage{stage}`` on this rank's slice of each global batch; compile per ``mode``
    (``eager``: not at all). The full fp32 state and the compile counts."""
    lo, hi = dist.get_rank() * PER_RANK, (dist.get_rank() + 1) * PER_RANK
    model = make_model()
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    opt = cls(model, torch.optim.AdamW, lr=LR, precision=precision, bucket_bytes=BUCKET_BYTES)
    net = compiled_net(model, mode)
    info: dict[str, Any] = {}
    start, t0 = frames(), time.monotonic()
    for step in range(WARMUP + COUNTED):
        if step == WARMUP:
            info["warmup_frames"], info["compile_s"] = frames() - start, time.monotonic() - t0
            start = frames()
        x, y = batch(step)
        stance = "fail_on_recompile" if step >= WARMUP and mode != "eager" else "default"
        with torch.compiler.set_stance(stance):
            loss_fn(net(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        opt.zero_grad()
    info["after_frames"] = frames() - start
    return opt.full_state_dict(), info


def scenario(stage: int, mode: str, precision: str, fp64: dict[str, torch.Tensor]) -> dict[str, Any]:
    eager, _ = train(stage, "eager", precision)
    torch.compiler.reset()  # each scenario compiles from scratch (Inductor's on-disk cache may still serve it)
    graphs = counters["stats"]["unique_graphs"]
    out: dict[str, Any] = {}
    try:
        compiled, out = train(stage, mode, precision)
        out["ratio"] = error_ratio(compiled, eager, fp64)
    except Exception as exc:  # the stance's RecompileError names the guard that failed
        out["recompile_error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        out["graphs"] = counters["stats"]["unique_graphs"] - graphs
    return out


def main(path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=120),
    )
    report: dict[str, Any] = {}
    try:
        fp64 = truth()
        for stage, mode, precision in SCENARIOS:
            t0 = time.monotonic()
            report[f"s{stage}_{mode}_{precision}"] = scenario(stage, mode, precision, fp64)
            report[f"s{stage}_{mode}_{precision}"]["wall_s"] = time.monotonic() - t0
        dist.barrier()
    except Exception:
        report["error"] = traceback.format_exc()
    finally:
        with open(f"{path}.rank{dist.get_rank()}", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
