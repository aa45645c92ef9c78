"""A small, configurable GPT (decoder-only transformer) in plain torch, for the examples and the engine benchmark.

No dependencies beyond torch. Two named sizes:

- ``tiny``  (~0.1M parameters): the example script and smoke runs; trains in seconds on a CPU core.
- ``bench`` (~29.5M parameters): the ZeRO engine benchmark (``bench/engine_bench.py``).

``GPTConfig.tie_embeddings`` shares the token embedding with the output head (a tied weight, the case ZeRO engines
must handle); it is off by default so every parameter is its own tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "bench": GPTConfig(vocab_size=4096, block_size=128, n_layer=8, n_head=8, n_embd=512),
    "large": GPTConfig(vocab_size=4096, block_size=128, n_layer=12, n_head=12, n_embd=768),
}


def config_for(size: str, **overrides: object) -> GPTConfig:
    """The named size (``tiny``, ``small``, ``bench``, ``large``: ~85M parameters at vocabulary 256) with optional
    field overrides."""
    try:
        base = SIZES[size]
    except KeyError:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {', '.join(SIZES)}") from None
    return replace(base, **overrides)  # type: ignore[arg-type]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (fused QKV projection, SDPA kernel)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward block (4x expansion, GELU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layer`` blocks, final LayerNorm, linear head over the vocabulary."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for token ids ``idx`` of shape ``(batch, seq)``."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Unique parameter count (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def synthetic_batch(
    cfg: GPTConfig, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic batch made locally: each row follows ``x[t+1] = (a * x[t] + b) mod vocab``.

    Every row has its own random start and (a, b) from a small set, so the model must read the context to predict
    the next token; loss falls quickly from ``ln(vocab)``. Returns ``(inputs, targets)`` of shape
    ``(batch_size, seq_len)``.
    """
    v = cfg.vocab_size
    start = torch.randint(0, v, (batch_size, 1), generator=generator)
    a = torch.randint(1, 4, (batch_size, 1), generator=generator) * 2 + 1
    b = torch.randint(0, 8, (batch_size, 1), generator=generator)
    seq = [start]
    for _ in range(seq_len):
        seq.append((a * seq[-1] + b) % v)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
