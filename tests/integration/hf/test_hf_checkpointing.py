"""``checkpoint_activations`` on Hugging Face models (tiny random-init GPT-2, BERT, T5, Llama built from configs, as in
``hf_worker``): it finds their decoder/encoder layers, and ZeroStage3 (world 1, in-process gloo) trains them with
checkpointing as without, each within the rounding the run without shows against plain AdamW in float64
(``ez_numerics.error_ratio`` <= 1); what autograd keeps from the forward shrinks. Llama and GPT-2 make a key/value
cache by default (``use_cache``): the checkpointed layers run without it, as under Hugging Face's own checkpointing."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator

import hf_worker
import pytest
import torch
import torch.distributed as dist
from torch import nn

from elasticzero import ZeroStage3
from elasticzero.engine import checkpoint_activations
from ez_numerics import error_ratio
from ez_testing import free_port, require

LAYERS = {
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "llama": ["model.layers.0", "model.layers.1"],
}
STEPS, LR = 2, 1e-3
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    require(importlib.util.find_spec("transformers") is not None, "transformers missing: pip install -e '.[test]'")
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: models are built from configs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _count(saved: list[int], t: torch.Tensor) -> torch.Tensor:
    saved.append(t.nbytes)
    return t


def _train(name: str, checkpoint: bool) -> tuple[dict[str, torch.Tensor], list[float], list[str], int]:
    """Stage 3 for STEPS steps: fp32 masters, losses, the layers checkpointed, bytes kept by the first forward."""
    model = hf_worker.train_mode(name, hf_worker.build(name))
    names = checkpoint_activations(model) if checkpoint else []
    opt = ZeroStage3(model, torch.optim.AdamW, lr=LR)
    losses, kept = [], []
    for step in range(STEPS):
        saved: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_count, saved), lambda t: t):
            loss = model(**hf_worker.make_batch(name, step, 0)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        kept.append(sum(saved))
    return opt.full_state_dict(), losses, names, kept[0]


def _truth(name: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model: nn.Module = hf_worker.train_mode(name, hf_worker.build(name).double())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**hf_worker.make_batch(name, step, 0, torch.float64)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return hf_worker.comparable(model), losses


@pytest.mark.parametrize("name", list(LAYERS))
def test_checkpointed_layers_train_like_plain_ones_under_stage3(world1: None, name: str) -> None:
    plain_params, plain_losses, _, plain_kept = _train(name, checkpoint=False)
    ckpt_params, ckpt_losses, names, ckpt_kept = _train(name, checkpoint=True)
    truth_params, truth_losses = _truth(name)
    assert names == LAYERS[name]
    assert error_ratio(ckpt_params, plain_params, truth_params) <= 1.0
    assert error_ratio(ckpt_losses, plain_losses, truth_losses) <= 1.0
    assert ckpt_kept < plain_kept, (ckpt_kept, plain_kept)
