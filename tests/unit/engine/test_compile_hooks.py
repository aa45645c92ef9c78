"""The ZeRO stages' hooks stay out of torch.compile's graphs (one process, a world-size-1 gloo group; Dynamo only,
``backend="eager"``, so it runs in seconds and on every supported torch in the torch-range stage).

Inductor itself, 2 ranks, bf16 and equality with eager training: tests/integration/engine/test_compile.py. Here:
per-block compile traces each block as one graph (no hook inside it, none traced), every block shares it (no guard on
per-block hook state), and later steps compile nothing (``fail_on_recompile``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import elasticzero

pytestmark = pytest.mark.timeout(120)
DIM, BLOCKS = 8, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)  # every block's input requires grad (a guard on it would split the first)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, DIM)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_block_compile_is_one_graph_for_every_block_and_never_recompiles(group: None, stage: int) -> None:
    torch.compiler.reset()
    model = Model()
    opt = getattr(elasticzero, f"ZeroStage{stage}")(model, torch.optim.AdamW, lr=1e-2)
    for block in model.blocks:
        block.compile(backend="eager")
    frames, breaks = counters["frames"]["total"], sum(counters["graph_break"].values())
    _steps(model, opt, 2)  # warm-up: stage 3 records the unit order in the first step, prefetches from the second
    assert counters["frames"]["total"] - frames == 1  # Block.forward, once, for all blocks
    assert sum(counters["graph_break"].values()) == breaks  # no hook, counter or resize was met inside it
    with torch.compiler.set_stance("fail_on_recompile"):
        _steps(model, opt, 2)
