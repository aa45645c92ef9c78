"""ZeRO-Offload on the CPU: the identity where the state already lives in host memory, and with ``cpu_copies`` the
host path itself (separate host masters and gradients, per-bucket steps on the worker thread, pushes) training to
the same numbers as the run without offload, by the ez_numerics rule (a float64 reference of the same math is the
truth), with fp32/bf16/fp16, clipping, accumulation, a partial offload by budget and the step taken during backward;
and checkpoints that load across placements (world-size-1 gloo group, one process)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.checkpoint import Checkpointer
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.engine.step import backward, optimizer_step
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from elasticzero.engine.zero.offload import OffloadOptions
from ez_numerics import error_ratio

pytestmark = pytest.mark.timeout(300)

STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
LR, WD, MAX_NORM = 2e-2, 0.1, 0.05  # the clip binds: these gradients' norms are above it
HOST = OffloadOptions(optimizer=True, cpu_copies=True)


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def batch(step: int, micro: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * step + micro))


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).float().square().mean()


def zero(stage: int, offload: OffloadOptions | None, precision: str = "fp32", seed: int = 0) -> Any:
    return STAGES[stage](
        model(seed), torch.optim.AdamW, precision=precision, bucket_bytes=512, offload=offload, lr=LR, weight_decay=WD
    )


def train(opt: Any, steps: int, *, accum: int = 1, clip: bool = False, scaler: Any = None, early: bool = False) -> None:
    for step in range(steps):
        for micro in range(accum):
            last = micro == accum - 1
            sync = opt.no_sync() if not last and opt.supports_no_sync else torch.enable_grad()
            arm = opt.stepping_in_backward(clipping=clip, loss_scaling=scaler is not None)
            with sync, arm if early and last else torch.enable_grad():
                backward(loss_of(opt.module, batch(step, micro)) / accum, scaler)
        optimizer_step(opt, scaler=scaler, max_norm=MAX_NORM if clip else None)


def truth(steps: int, *, accum: int = 1, clip: bool = False) -> dict[str, torch.Tensor]:
    """The same training in float64, plain torch."""
    net = model().double()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in range(steps):
        for micro in range(accum):
            (loss_of(net, batch(step, micro).double()) / accum).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in net.state_dict().items()}


def weights(opt: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in opt.full_state_dict().items()}


def assert_offloaded(opt: Any) -> None:
    hosts = [i for i in range(len(opt.masters)) if opt.home(i).host]
    assert hosts, "nothing was offloaded"
    for i in hosts:  # a master of its own, in host memory, with its gradient there too
        assert opt.masters[i].device.type == "cpu"
        assert not opt.master_views_params(i)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_a_cpu_device_offload_is_the_identity(group: None, stage: int) -> None:
    params = OffloadOptions(optimizer=True, params=stage == 3)
    opt = zero(stage, params)
    assert not any(opt.home(i).host for i in range(len(opt.masters)))
    plain = zero(stage, None)
    train(opt, 2)
    train(plain, 2)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, plain.masters, strict=True))


CASES = [
    # stage, precision, accumulation, clip, loss scaler, early step, offload
    (1, "fp32", 1, True, False, False, HOST),
    (2, "fp32", 2, True, False, False, HOST),
    (3, "fp32", 2, False, False, False, OffloadOptions(optimizer=True, params=True, cpu_copies=True)),
    (1, "bf16", 2, False, False, True, HOST),
    (2, "bf16", 1, False, False, True, HOST),
    (3, "bf16", 1, True, False, False, HOST),
    (2, "fp16", 1, True, True, False, HOST),
    (3, "fp16", 2, False, True, True, HOST),  # armed, but the scaler forbids the early step
    (2, "fp32", 1, False, False, True, OffloadOptions(optimizer=True, ratio=0.5, cpu_copies=True)),
    (3, "fp32", 1, False, False, True, OffloadOptions(optimizer=True, device_budget_bytes=2000, cpu_copies=True)),
]


@pytest.mark.parametrize(("stage", "precision", "accum", "clip", "scaled", "early", "offload"), CASES)
def test_host_path_trains_like_the_device_path(
    group: None,
    stage: int,
    precision: str,
    accum: int,
    clip: bool,
    scaled: bool,
    early: bool,
    offload: OffloadOptions,
) -> None:
    steps = 3
    got, ref = zero(stage, offload, precision), zero(stage, None, precision)
    assert_offloaded(got)
    if offload.ratio < 1 or offload.device_budget_bytes is not None:  # partial: some buckets stay
        assert not all(got.home(i).host for i in range(len(got.masters)))
    for opt in (got, ref):
        scaler = LossScaler(2.0**10) if scaled else None
        train(opt, steps, accum=accum, clip=clip, scaler=scaler, early=early)
    want = truth(steps, accum=accum, clip=clip)
    ratio = error_ratio(weights(got), weights(ref), want)
    assert ratio <= 1.0, ratio
    assert error_ratio(weights(got), want, want) > 1.0  # the rule sees rounding: a wrong step would show
    for m_got, m_ref in zip(got.masters, ref.masters, strict=True):  # the optimizer state went the same way
        for k, v in ref.optim.state[m_ref].items():
            if torch.is_tensor(v) and v.dim() == 1:
                assert error_ratio(got.optim.state[m_got][k], v, v.double()) <= 1.0 or torch.equal(
                    got.optim.state[m_got][k], v
                )


def test_the_early_step_happens_in_backward_and_only_once(group: None) -> None:
    opt = zero(2, HOST)
    before = [m.detach().clone() for m in opt.masters]
    with opt.stepping_in_backward() as reason:
        assert reason is None
        loss_of(opt.module, batch(0, 0)).backward()
    offloader = opt._offload
    assert offloader._steps.stepped == set(offloader.plan.offloaded())  # submitted while backward ran
    offloader._pushed.update(offloader._steps.wait())
    assert not any(torch.equal(a, m) for a, m in zip(before, opt.masters, strict=True))  # stepped already
    opt.step()
    ref = zero(2, None)
    loss_of(ref.module, batch(0, 0)).backward()
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, ref.masters, strict=True))  # not stepped twice


@pytest.mark.parametrize(("clip", "scaled", "why"), [(True, False, "clipping"), (False, True, "overflow")])
def test_the_early_step_is_refused_with_its_reason(group: None, clip: bool, scaled: bool, why: str) -> None:
    opt = zero(1, HOST)
    with opt.stepping_in_backward(clipping=clip, loss_scaling=scaled) as reason:
        assert why in reason
        loss_of(opt.module, batch(0, 0)).backward()
    before = [m.detach().clone() for m in opt.masters]
    assert opt._offload._steps.stepped == set()  # nothing submitted in backward
    assert all(torch.equal(a, m) for a, m in zip(before, opt.masters, strict=True))  # nothing stepped yet


@pytest.mark.parametrize(("stage_saved", "stage_loaded"), [(2, 2), (3, 1), (1, 3)])
@pytest.mark.parametrize("saved_offloaded", [True, False])
def test_checkpoints_load_across_placements(
    group: None, tmp_path: Path, stage_saved: int, stage_loaded: int, saved_offloaded: bool
) -> None:
    """Saved offloaded, loaded on the device, and the reverse (across stages too): the same keys and shapes, the
    same bits, and the loaded run continues as the saved one does."""
    saved = zero(stage_saved, HOST if saved_offloaded else None, "bf16")
    train(saved, 2)
    loaded = zero(stage_loaded, None if saved_offloaded else HOST, "bf16", seed=5)
    with Checkpointer(tmp_path, keep_last=1) as ckpt:
        ckpt.save(2, {"zero": ZeroCheckpointState(saved)})
        assert ckpt.load_latest({"zero": ZeroCheckpointState(loaded)}) == 2
    mine, theirs = ZeroCheckpointState(loaded).state_dict(), ZeroCheckpointState(saved).state_dict()
    assert sorted(mine["params"]) == sorted(theirs["params"])
    for name, chunk in theirs["params"].items():
        assert torch.equal(mine["params"][name].tensor, chunk.tensor)
        for k, st in theirs["optim"]["state"][name].items():
            assert torch.equal(mine["optim"]["state"][name][k].tensor, st.tensor)
    twin = copy.deepcopy(saved.full_state_dict())
    train(saved, 1)
    train(loaded, 1)
    after_saved, after_loaded = weights(saved), weights(loaded)
    assert twin.keys() == after_loaded.keys()
    assert all(torch.equal(after_saved[k], after_loaded[k]) for k in after_saved)
