"""The optimizer-step path's costs (issue 23): the fused default over the flat masters, one-rank collectives done
locally, reused bucket buffers and gradient shards, and lazily zeroed kept buffers — each checked for what it must
keep (the same numbers) and what it must drop (a copy, an allocation). World size 1 gloo group, one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import GradBucketer, ZeroStage1, ZeroStage2
from elasticzero.engine.zero.comm.communicator import Communicator
from elasticzero.engine.zero.comm.work import same_memory
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from elasticzero.engine.zero.inner import optimizer_kwargs_for

pytestmark = pytest.mark.timeout(120)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _backward(model: nn.Module, i: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + i))
    model(x).square().mean().backward()


# -- the fused default ----------------------------------------------------------------------------------------------
def test_fused_is_asked_for_only_where_the_caller_chose_nothing() -> None:
    assert optimizer_kwargs_for(torch.optim.AdamW, {"lr": 0.1}) == {"lr": 0.1, "fused": True}
    assert optimizer_kwargs_for(torch.optim.AdamW, {"fused": False}) == {"fused": False}
    assert optimizer_kwargs_for(torch.optim.AdamW, {"foreach": True}) == {"foreach": True}
    assert optimizer_kwargs_for(torch.optim.RMSprop, {"lr": 0.1}) == {"lr": 0.1}  # no fused kernel: left alone


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage2])
def test_the_wrapped_optimizer_is_fused_and_steps_like_fused_adamw(group: None, stage: Any) -> None:
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model = _model()
    opt = stage(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, bucket_bytes=256)  # several buckets
    assert all(g["fused"] is True for g in opt.param_groups)
    for i in range(3):
        for m, o in ((ref_model, ref), (model, opt)):
            _backward(m, i)
            o.step()
            o.zero_grad()
    for got, want in zip(model.parameters(), ref_model.parameters(), strict=True):  # the same element-wise kernel
        assert torch.equal(got, want)


def test_a_caller_refusing_fused_keeps_torch_default(group: None) -> None:
    opt = ZeroStage2(_model(), torch.optim.AdamW, lr=1e-2, fused=False)
    assert opt.param_groups[0]["fused"] is False
    differentiable = ZeroStage2(_model(), torch.optim.AdamW, lr=1e-2, differentiable=True)  # torch refuses fused here
    assert not differentiable.param_groups[0]["fused"]


def test_a_load_keeps_this_runs_implementation_choices(group: None) -> None:
    saved = ZeroStage2(_model(), torch.optim.AdamW, lr=1e-2, fused=False)
    _backward(saved.module, 0)
    saved.step()
    resumed = ZeroStage2(_model(1), torch.optim.AdamW, lr=3e-2)
    state = ZeroCheckpointState(resumed)
    state.load_state_dict(ZeroCheckpointState(saved).state_dict())
    assert resumed.param_groups[0]["lr"] == 1e-2  # what was trained comes back
    assert resumed.param_groups[0]["fused"] is True  # how this run steps does not


# -- one-rank collectives -------------------------------------------------------------------------------------------
def test_one_rank_reduce_scatter_and_all_gather_are_local_and_counted(group: None) -> None:
    c = Communicator()
    src, out = torch.arange(6.0), torch.empty(6)
    work = c.reduce_scatter(out, src, async_op=True)
    assert work is not None and work.done and c.pending == 0 and c.unsettled == 0  # nothing handed to gloo
    assert torch.equal(out, src)
    buf = torch.arange(4.0)
    c.all_gather(buf, buf[:])  # in place: nothing to copy
    assert torch.equal(buf, torch.arange(4.0))
    assert c.stats.elements[("reduce_scatter", "grad")] == 6 and c.stats.elements[("all_gather", "param")] == 4


def test_same_memory_means_the_same_elements() -> None:
    t = torch.arange(8.0)
    assert same_memory(t[2:6], t[2:6].view(2, 2).reshape(-1))
    assert not same_memory(t[2:6], t[2:5]) and not same_memory(t[:4], t[4:])
    assert not same_memory(t, t.view(torch.int32))  # another dtype
    assert not same_memory(t.view(2, 4).t(), t.view(2, 4).t())  # non-contiguous: never assumed


def test_one_rank_bucket_is_its_own_shard(group: None) -> None:
    model = _model()
    seen: list[tuple[torch.Tensor, Any]] = []
    bucketer = GradBucketer(
        model.parameters(), op="reduce_scatter", on_reduced=lambda b, shard: seen.append((shard, b)), bucket_bytes=256
    )
    _backward(model, 0)
    assert seen and all(shard.numel() == b.padded_numel for shard, b in seen)
    assert bucketer.held_buffers() == []  # each buffer went to on_reduced as the shard; nothing kept or pooled


# -- kept buffers ---------------------------------------------------------------------------------------------------
def test_one_rank_stage2_keeps_its_buckets_as_stage1(group: None) -> None:
    """One rank: the shard is the whole bucket, so stage 2 holds what stage 1 holds and trains the same, bitwise."""
    one = ZeroStage1(_model(), torch.optim.AdamW, lr=1e-2, bucket_bytes=256)
    two = ZeroStage2(_model(), torch.optim.AdamW, lr=1e-2, bucket_bytes=256)
    assert two.bucketer.keep_buffers
    for i in range(3):
        for opt in (one, two):
            _backward(opt.module, i)
            if i == 2:
                assert all(
                    m.grad.data_ptr() == opt.bucketer.buffer(b).data_ptr()
                    for b, m in zip(opt.buckets, opt.masters, strict=True)
                )
            opt.step()
            opt.zero_grad()
    for got, want in zip(two.module.parameters(), one.module.parameters(), strict=True):
        assert torch.equal(got, want)


def test_kept_buffers_are_zeroed_lazily(group: None) -> None:
    opt = ZeroStage1(_model(), torch.optim.SGD, lr=0.1, bucket_bytes=256)
    _backward(opt.module, 0)
    first = [m.grad.clone() for m in opt.masters]
    opt.zero_grad()
    assert all(opt.bucketer._unwritten[b.index] for b in opt.buckets)  # marked, not filled
    _backward(opt.module, 0)
    for m, want in zip(opt.masters, first, strict=True):  # written, not added onto the previous step's
        assert torch.equal(m.grad, want)
    _backward(opt.module, 0)  # no zero_grad: accumulates
    for m, want in zip(opt.masters, first, strict=True):
        assert torch.equal(m.grad, 2 * want)
