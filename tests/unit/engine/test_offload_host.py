"""ZeRO-Offload's moving parts on the CPU (engine/zero/host.py): host gradients landed and settled, one bucket
stepped at a time equal to the wrapped optimizer's step, the optimizer-state size probe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero.engine.zero.base import offloaded_step
from elasticzero.engine.zero.host import BucketSteps, CopyStream, HostGrads, Offloader, state_bytes_per_element
from elasticzero.engine.zero.offload import OffloadOptions, plan_homes

HOME = plan_homes(OffloadOptions(optimizer=True, cpu_copies=True), "cpu", [1, 1]).homes


def grads() -> HostGrads:
    return HostGrads({0: 4, 1: 3}, HOME, CopyStream(torch.device("cpu"), enabled=False))


def test_a_first_fp32_landing_is_the_gradient() -> None:
    g = grads()
    g.land(0, torch.arange(4.0), accumulate=False)
    g.settle_all()
    assert torch.equal(g.grads[0], torch.arange(4.0))
    assert g.pending() == []


def test_later_landings_add_and_low_precision_is_cast_up() -> None:
    g = grads()
    g.land(1, torch.ones(3), accumulate=False)
    g.land(1, torch.full((3,), 2.0, dtype=torch.bfloat16), accumulate=True)  # settles the first, stages this one
    assert g.pending() == [1]
    g.settle(1)
    assert torch.equal(g.grads[1], torch.full((3,), 3.0))
    g.land(1, torch.full((3,), 0.5, dtype=torch.bfloat16), accumulate=False)  # a new step's first: cast, no add
    g.settle_all()
    assert torch.equal(g.grads[1], torch.full((3,), 0.5))


def test_a_landing_reads_the_shard_once() -> None:
    """The host gradient is a copy: the device shard may be reused once the landing settled."""
    g, shard = grads(), torch.arange(4.0)
    g.land(0, shard, accumulate=False)
    g.settle(0)
    shard.zero_()
    assert torch.equal(g.grads[0], torch.arange(4.0))


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0, "lr": 0.02}]
    return torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95), fused=True)


def test_bucket_steps_equal_the_wrapped_optimizer_bitwise() -> None:
    """Each bucket stepped alone (twice, the lr changed by a 'scheduler' between) lands on the same bits as the
    wrapped optimizer stepping them together: AdamW is element-wise, each master has its own state."""
    torch.manual_seed(0)
    start = [torch.randn(5), torch.randn(7)]
    grads_seq = [[torch.randn(5), torch.randn(7)] for _ in range(2)]
    ref = [nn.Parameter(t.clone()) for t in start]
    got = [nn.Parameter(t.clone()) for t in start]
    ref_opt, got_opt = adamw(ref), adamw(got)
    steps = BucketSteps(got_opt, got)
    try:
        for k, gs in enumerate(grads_seq):
            for p, q, g in zip(ref, got, gs, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            ref_opt.step()
            steps.submit(1, lambda: None, lambda: None)  # on the worker
            steps.step_now(0)  # here
            steps.wait()
            steps.done()
            for opt in (ref_opt, got_opt):
                opt.param_groups[0]["lr"] = 0.005 * (k + 2)
        for p, q in zip(ref, got, strict=True):
            assert torch.equal(p, q)
            assert all(torch.equal(ref_opt.state[p][k], got_opt.state[q][k]) for k in ref_opt.state[p])
    finally:
        steps.close()


def test_a_step_that_raises_raises_at_wait() -> None:
    p = nn.Parameter(torch.zeros(2))
    steps = BucketSteps(torch.optim.SGD([p], lr=0.1), [p])

    def fail() -> None:
        raise ValueError("boom")

    try:
        steps.submit(0, fail, lambda: None)
        with pytest.raises(ValueError, match="boom"):
            steps.wait()
    finally:
        steps.close()


@pytest.mark.parametrize(
    ("cls", "kwargs", "want"),
    [
        (torch.optim.AdamW, {"lr": 1e-3}, 8),
        (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True, "fused": True}, 12),
        (torch.optim.SGD, {"lr": 0.1}, 0),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 4),
    ],
)
def test_state_bytes_per_element(cls: type[torch.optim.Optimizer], kwargs: dict[str, object], want: int) -> None:
    assert state_bytes_per_element(cls, dict(kwargs)) == want


def test_offloader_moves_masters_steps_and_pushes_on_the_cpu() -> None:
    """The whole cycle with synchronous copies: adopt (a host copy), land, step on the worker, push into the
    device-side target; the master that stays resident is the same object."""
    plan = plan_homes(OffloadOptions(optimizer=True, ratio=0.5, cpu_copies=True), "cpu", [40, 8])
    assert [h.host for h in plan.homes] == [True, False]
    off = Offloader(plan, torch.device("cpu"))
    resident = nn.Parameter(torch.ones(2))
    device_view = torch.zeros(10)
    away = off.adopt(0, nn.Parameter(device_view))
    assert away.data_ptr() != device_view.data_ptr() and off.adopt(1, resident) is resident
    masters = [away, resident]
    opt = torch.optim.SGD(masters, lr=1.0)
    off.bind(opt, masters, [torch.bfloat16, torch.float32])
    target = torch.empty(10, dtype=torch.bfloat16)
    off.push_into(0, target)
    try:
        off.reduced(0, torch.full((10,), 2.0))
        resident.grad = torch.ones(2)
        off.end_backward()
        off.step()
        assert torch.equal(away.detach(), torch.full((10,), -2.0))
        assert torch.equal(target, torch.full((10,), -2.0, dtype=torch.bfloat16))
        assert torch.equal(off.source(0), target)
        assert torch.equal(resident.detach(), torch.zeros(2))
    finally:
        off.close()


def test_armed_offloader_steps_during_backward() -> None:
    plan = plan_homes(OffloadOptions(optimizer=True, cpu_copies=True), "cpu", [4])
    off = Offloader(plan, torch.device("cpu"))
    master = off.adopt(0, nn.Parameter(torch.zeros(4)))
    off.bind(torch.optim.SGD([master], lr=1.0), [master], [torch.float32])
    try:
        off.armed = True
        off.reduced(0, torch.ones(4))
        off.step()  # waits for the step the landing started; steps nothing twice
        assert torch.equal(master.detach(), torch.full((4,), -1.0))
    finally:
        off.close()


def test_an_offloaded_step_runs_the_wrapped_optimizers_step_hooks() -> None:
    """The offloaded step stands for ``optim.step()``: its pre-hook sees the master before the step, its post-hook
    after, once each (the buddy copies step their shadow optimizers from these hooks, live/copies.py)."""
    plan = plan_homes(OffloadOptions(optimizer=True, cpu_copies=True), "cpu", [4])
    off = Offloader(plan, torch.device("cpu"))
    master = off.adopt(0, nn.Parameter(torch.zeros(4)))
    optim = torch.optim.SGD([master], lr=1.0)
    off.bind(optim, [master], [torch.float32])
    seen: list[tuple[str, float]] = []
    optim.register_step_pre_hook(lambda o, a, k: seen.append(("pre", master.detach()[0].item())))
    optim.register_step_post_hook(lambda o, a, k: seen.append(("post", master.detach()[0].item())))
    try:
        off.reduced(0, torch.ones(4))
        off.end_backward()
        offloaded_step(optim, off)
        assert seen == [("pre", 0.0), ("post", -1.0)]
    finally:
        off.close()
