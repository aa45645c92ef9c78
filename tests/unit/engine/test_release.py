"""``ZeroOptimizer.release()``: a model and optimizer dropped while the process goes on (a live round change) are
collected once the optimizer's hooks are off — and are not without it: a parameter's post-accumulate-grad hook is held
by autograd's C++ node, an edge Python's collector cannot see (the live loop's ~5x-the-model leak per round)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3

STAGES = [ZeroStage1, ZeroStage2, ZeroStage3]
pytestmark = pytest.mark.usefixtures("group")


def trained(stage: Any) -> tuple[weakref.ref[Any], weakref.ref[nn.Module], Any]:
    """A small model and its optimizer after one step; weak references to both, and the optimizer."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = stage(model, torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return weakref.ref(opt), weakref.ref(model), opt


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.__name__)
def test_a_released_optimizer_and_its_model_are_collected(stage: Any) -> None:
    opt_ref, model_ref, opt = trained(stage)
    opt.release()
    del opt
    gc.collect()
    assert opt_ref() is None and model_ref() is None


@pytest.mark.parametrize("stage", [ZeroStage2], ids=lambda s: s.__name__)
def test_without_release_the_parameters_hooks_keep_them_alive(stage: Any) -> None:
    """The reason for ``release``: unreachable from Python, yet never collected (torch holds the hooks in C++)."""
    opt_ref, model_ref, opt = trained(stage)
    del opt
    gc.collect()
    assert opt_ref() is not None and model_ref() is not None
    opt_ref().release()  # type: ignore[union-attr]  # let this test's own go
    gc.collect()
    assert opt_ref() is None and model_ref() is None
