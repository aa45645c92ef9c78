"""``activation_checkpointing`` in a config (native or DeepSpeed): ``build_pieces`` checkpoints the model's repeated
blocks under every ZeRO stage, on a real single-rank gloo group.

Numerics: a run with checkpointing is compared with the same stage without it, both against plain AdamW in float64
(``ez_numerics.error_ratio`` <= 1: no further from the truth than 3x what rounding moved the run without
checkpointing). That checkpointing keeps no activations is seen in what autograd saves: every tensor saved during the
forward passes through a ``saved_tensors_hooks`` pair around it (checkpointing's own hooks take the blocks' interior
over, so what reaches ours is what stays in memory until the backward).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticzero.config import build_pieces, load_config
from elasticzero.errors import UsageError
from ez_numerics import error_ratio
from ez_testing import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from gpt import GPT, config_for, lm_loss, synthetic_batch

GPT_CFG = config_for("tiny", n_layer=3)
BATCH, SEQ, STEPS, LR, CLIP = 4, 32, 3, 3e-3, 0.5
BASE = {
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
    "clip_grad_norm": CLIP,
    "micro_batch_size": BATCH,
}


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG).to(dtype)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [synthetic_batch(GPT_CFG, BATCH, SEQ, gen) for _ in range(STEPS)]


def _train(cfg: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[float], list[int], list[str]]:
    """Final fp32 masters, the losses, the bytes autograd kept from each forward, the blocks checkpointed."""
    model = _model()
    pieces = build_pieces(model, cfg)
    net = pieces.wrap(model)  # DDP at stage 0
    losses, kept = [], []
    for x, y in _batches():
        saved: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_count, saved), lambda t: t):
            loss = lm_loss(net(x), y)
        pieces.backward(loss)
        pieces.step()
        losses.append(loss.item())
        kept.append(sum(saved))
    masters = (
        {k: p.detach() for k, p in model.named_parameters()}
        if cfg["zero"]["stage"] == 0
        else pieces.optimizer.full_state_dict()  # type: ignore[operator]
    )
    return masters, losses, kept, pieces.checkpointed


def _count(saved: list[int], t: torch.Tensor) -> torch.Tensor:
    saved.append(t.nbytes)
    return t


def _truth() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain AdamW with the same clip, in float64."""
    model = _model(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for x, y in _batches():
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.named_parameters()}, losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])  # 0: DDP and a plain AdamW
def test_checkpointed_training_equals_plain_and_keeps_no_block_activations(world1: None, stage: int) -> None:
    plain = _train({**BASE, "zero": {"stage": stage}})
    ckpt = _train({**BASE, "zero": {"stage": stage}, "activation_checkpointing": {"enabled": True}})
    truth_params, truth_losses = _truth()
    assert plain[3] == [] and ckpt[3] == ["blocks.0", "blocks.1", "blocks.2"]
    assert error_ratio(ckpt[0], plain[0], truth_params) <= 1.0
    assert error_ratio(ckpt[1], plain[1], truth_losses) <= 1.0
    # without checkpointing every block keeps its interior (the MLP's 4x-wide GELU input alone is B*T*4C floats a
    # block); with it, a block keeps only its input (B*T*C floats), saved once per block
    interior = GPT_CFG.n_layer * BATCH * SEQ * 4 * GPT_CFG.n_embd * 4
    assert all(c <= p - interior for c, p in zip(ckpt[2], plain[2], strict=True)), (ckpt[2], plain[2])


def test_deepspeed_block_turns_it_on_with_cpu_checkpointing(world1: None) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3},
    }
    cfg = load_config(ds, world_size=1)
    assert cfg.activation_checkpointing.enabled and cfg.activation_checkpointing.cpu
    model = _model()
    pieces = build_pieces(model, cfg)
    assert pieces.checkpointed == ["blocks.0", "blocks.1", "blocks.2"]
    x, y = _batches()[0]
    pieces.backward(lm_loss(model(x), y))  # on the CPU the saved inputs stay where they are (host_save_plan: None)
    assert not pieces.step().skipped


def test_blocks_by_class_name_and_a_missing_class_is_one_line(world1: None) -> None:
    model = _model()
    pieces = build_pieces(model, {**BASE, "activation_checkpointing": {"enabled": True, "blocks": "MLP"}})
    assert pieces.checkpointed == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    fresh = _model()
    with pytest.raises(UsageError, match=r"activation_checkpointing\.blocks: no module of class 'Blok' in GPT"):
        build_pieces(
            fresh, {**BASE, "zero": {"stage": 2}, "activation_checkpointing": {"enabled": True, "blocks": "Blok"}}
        )
    assert "forward" not in fresh.blocks[0].__dict__  # refused before anything was built or wrapped
