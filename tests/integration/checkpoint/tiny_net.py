"""The tiny model of the checkpoint tests and its world-size-independent batches: torch only, so the DeepSpeed
fixture generator (``make_deepspeed_fixtures.py``, run in DeepSpeed's venv) trains the very same model. Every kind of
state: uneven parameter sizes, a tied weight, a frozen parameter, a buffer."""

from __future__ import annotations

import torch
from torch import nn

GLOBAL_BATCH = 6  # divisible by every world size used (1, 2, 3)
VOCAB = 11
LR, WD = 0.05, 0.1  # torch.optim.AdamW, here and in DeepSpeed (make_deepspeed_fixtures.py)


class Scale(nn.Module):
    """One element: on 2 or 3 ranks its bucket leaves some ranks only padding."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.g


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 7), nn.Linear(7, 6), Scale()])
        self.frozen = nn.Linear(6, 6)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h)) if isinstance(b, nn.Linear) else b(h)
        return self.head(self.frozen(h))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, 5), generator=g)
    return x, torch.roll(x, 1, dims=1)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on one rank's slice (the mean of equal slices' means is the global mean), in
    fp32 for a bf16 model and in the model's dtype for an fp32 or fp64 one (the tests' float64 truth)."""
    logits = model(x).reshape(-1, VOCAB)
    return nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y.reshape(-1))
