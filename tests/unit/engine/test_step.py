"""optimizer_step: unscale → clip → step → update → zero_grad, the same call for a ZeRO stage and a plain optimizer
(alone or under DDP), with or without a LossScaler, on a real single-rank gloo group. Each case is compared with the
sequence written out by hand on an identical copy (the same ops in the same order: equal to the bit)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from elasticzero.engine import StepResult, backward, optimizer_step
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.engine.zero import ZeroStage2

MAX_NORM = 0.05  # well below the gradients' norm here, so the clip changes the update


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _loss(net: nn.Module) -> torch.Tensor:
    x, y = _batch()
    return (net(x) - y).square().mean()


def _plain(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _zero(model: nn.Module) -> torch.optim.Optimizer:
    return ZeroStage2(model, torch.optim.AdamW, lr=1e-2)


def _scaler() -> LossScaler:
    return LossScaler(2.0**10, hysteresis=1)


def _by_hand(opt: torch.optim.Optimizer, scaler: LossScaler | None, max_norm: float) -> torch.Tensor:
    """The loop the helper replaces, written out (the example's old branches)."""
    if scaler:
        scaler.unscale_(opt)
    own = getattr(opt, "clip_grad_norm_", None)
    params = [p for g in opt.param_groups for p in g["params"]]
    norm = own(max_norm) if callable(own) else torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(opt) if scaler else opt.step()
    if scaler:
        scaler.update()
    opt.zero_grad(set_to_none=True)
    return norm


CASES = [
    pytest.param(_plain, False, False, id="plain"),
    pytest.param(_plain, True, False, id="plain-scaler"),
    pytest.param(_plain, True, True, id="ddp-scaler"),
    pytest.param(_zero, False, False, id="zero2"),
    pytest.param(_zero, True, False, id="zero2-scaler"),
]


@pytest.mark.parametrize(("make_opt", "scaled", "ddp"), CASES)
def test_matches_the_hand_written_sequence(
    group: None, make_opt: Callable[[nn.Module], torch.optim.Optimizer], scaled: bool, ddp: bool
) -> None:
    runs = []
    for helper in (True, False):
        model = _model()
        net, opt = nn.parallel.DistributedDataParallel(model) if ddp else model, make_opt(model)
        scaler = _scaler() if scaled else None
        norms = []
        for _ in range(3):
            backward(_loss(net), scaler)
            if helper:
                result = optimizer_step(opt, scaler=scaler, max_norm=MAX_NORM)
                assert result.skipped is False and result.grad_norm is not None
                norms.append(result.grad_norm)
            else:
                norms.append(_by_hand(opt, scaler, MAX_NORM))
            assert all(p.grad is None for p in model.parameters())
        runs.append((copy.deepcopy(model.state_dict()), norms, scaler and scaler.get_scale()))
    (helped, helped_norms, helped_scale), (manual, manual_norms, manual_scale) = runs
    assert helped_norms[0] > MAX_NORM  # the clip was active
    assert all(torch.equal(a, b) for a, b in zip(helped_norms, manual_norms, strict=True))
    assert helped.keys() == manual.keys() and all(torch.equal(helped[k], manual[k]) for k in helped)
    assert helped_scale == manual_scale
    assert not torch.equal(helped["0.weight"], _model().state_dict()["0.weight"])  # it trained


@pytest.mark.parametrize("make_opt", [_plain, _zero], ids=["plain", "zero2"])
def test_an_overflow_skips_clip_and_step_and_still_releases_the_grads(
    group: None, make_opt: Callable[[nn.Module], torch.optim.Optimizer]
) -> None:
    model = _model()
    opt, scaler = make_opt(model), _scaler()
    before = copy.deepcopy(model.state_dict())
    backward(_loss(model) * float("inf"), scaler)
    result = optimizer_step(opt, scaler=scaler, max_norm=MAX_NORM)
    assert result == StepResult(skipped=True, grad_norm=None)
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**9  # backed off once (hysteresis 1)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_no_clipping_without_max_norm(group: None) -> None:
    model = _model()
    opt = _plain(model)
    backward(_loss(model))
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    reference = _model()
    ref_opt = _plain(reference)
    for p, g in zip(reference.parameters(), grads, strict=True):
        p.grad = g.clone()
    ref_opt.step()
    assert optimizer_step(opt) == StepResult(skipped=False, grad_norm=None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_step_taken_elsewhere_moves_the_scale_as_a_clean_step_here(group: None) -> None:
    """``LossScaler.count_taken_step`` (a live reshard's step counted done) leaves the scaler where ``optimizer_step``
    leaves an identical one after a real clean step: through a growth (interval 2) and between two."""
    taken, counted = (LossScaler(4.0, growth_interval=2) for _ in range(2))
    model = _model()
    opt = _plain(model)
    for _ in range(3):
        backward(_loss(model), taken)
        assert not optimizer_step(opt, scaler=taken).skipped
        counted.count_taken_step()
        assert counted.state_dict() == taken.state_dict()
    assert taken.get_scale() == 8.0  # it grew once: the counted copy followed a real change
