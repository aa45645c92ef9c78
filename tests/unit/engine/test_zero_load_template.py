"""ZeroCheckpointState.load_template: a resume reads into buffers the optimizer then adopts (no second copy of the
state, no filled-then-overwritten moments), with the same result as the copying path (one process, world-size-1
gloo group); and the checkpoint's garbage-collection pause is counted and restores what it found."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage3
from elasticzero.checkpoint import Checkpointer
from elasticzero.checkpoint.gcpause import GcPause
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState, _zero_padding

pytestmark = pytest.mark.timeout(120)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _trained(stage: Any, steps: int, seed: int = 0) -> Any:
    opt = stage(_model(seed), torch.optim.AdamW, lr=1e-2, bucket_bytes=256)  # several buckets
    for i in range(steps):
        _step(opt, i)
    return opt


def _step(opt: Any, i: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + i))
    opt.module(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(opt: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for m in opt.masters for t in (m, *opt.optim.state[m].values()) if t.dim() == 1]


@pytest.mark.parametrize("stage", [ZeroStage1, ZeroStage3])
def test_resume_adopts_the_loaded_buffers(group: None, tmp_path: Path, stage: Any) -> None:
    saved = _trained(stage, 3)
    with Checkpointer(tmp_path, keep_last=1) as ckpt:
        ckpt.save(3, {"zero": ZeroCheckpointState(saved)})
        resumed = _trained(stage, 0, seed=7)  # another init, no optimizer state yet
        masters = list(resumed.masters)
        storage_before = [m.untyped_storage().data_ptr() for m in masters]
        zs = ZeroCheckpointState(resumed)
        assert ckpt.load_latest({"zero": zs}) == 3
    assert all(a is b for a, b in zip(resumed.masters, masters, strict=True))  # identity kept (param_groups)
    assert all(a.equal(b) for a, b in zip(_snapshot(resumed), _snapshot(saved), strict=True))  # bit-exact
    moved = [m.untyped_storage().data_ptr() != p for m, p in zip(masters, storage_before, strict=True)]
    # stage 3 masters own their storage: swapped; stage 1 fp32 masters live in the buffer the module's parameters view
    # (at world size 1 the view is the whole buffer): copied into it, so the parameters still read the masters
    assert moved == [stage is ZeroStage3] * len(masters)
    assert [resumed.master_views_params(i) for i in range(len(masters))] == [stage is ZeroStage1] * len(masters)
    assert not zs._fresh  # the template was consumed: its buffers are the optimizer's now, not adoptable again
    for i in range(3, 5):  # and training goes on exactly as it would have
        _step(saved, i)
        _step(resumed, i)
    assert all(a.equal(b) for a, b in zip(_snapshot(resumed), _snapshot(saved), strict=True))


def test_template_buffers_are_adopted_not_copied(group: None) -> None:
    opt = _trained(ZeroStage3, 0)
    zs = ZeroCheckpointState(opt)
    template = zs.load_template()
    for name, chunk in template["params"].items():  # what dcp.load would do: fill the template in place
        chunk.tensor.copy_(torch.arange(chunk.tensor.numel(), dtype=chunk.tensor.dtype))
        for c in template["optim"]["state"][name].values():
            c.tensor.fill_(0.5)
    zs.load_state_dict(template)
    live_state = {t.untyped_storage().data_ptr() for m in opt.masters for t in opt.optim.state[m].values()}
    live_masters = {m.untyped_storage().data_ptr() for m in opt.masters}
    for name, chunk in template["params"].items():
        assert chunk.tensor.untyped_storage().data_ptr() in live_masters
        state = template["optim"]["state"][name]
        assert state and all(c.tensor.untyped_storage().data_ptr() in live_state for c in state.values())
    assert torch.equal(opt.optim.state[opt.masters[0]]["exp_avg"], torch.full_like(opt.masters[0], 0.5))
    assert all(int(opt.optim.state[m]["step"]) == 0 for m in opt.masters)


def test_an_unused_template_touches_nothing_and_is_not_kept(group: None) -> None:
    opt = _trained(ZeroStage3, 2)
    before = _snapshot(opt)
    zs = ZeroCheckpointState(opt)
    template = zs.load_template()
    for chunk in template["params"].values():
        chunk.tensor.fill_(float("nan"))  # a load that failed half-way
    assert zs._fresh
    del template, chunk
    gc.collect()
    assert not zs._fresh
    assert all(a.equal(b) for a, b in zip(_snapshot(opt), before, strict=True))


def test_zero_padding_clears_only_what_no_piece_covers() -> None:
    flat = torch.full((10,), 7.0)
    _zero_padding(flat, [("b", 0, 3, 5), ("a", 2, 4, 1)])  # pieces out of order: [1, 3) and [5, 8) are data
    assert flat.tolist() == [0, 7, 7, 0, 0, 7, 7, 7, 0, 0]


def test_gc_pause_is_counted_and_restores_what_it_found() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        pause = GcPause()
        pause.enter()
        with pause():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
        left = threading.Thread(target=pause.leave)  # a background save ends its pause in its own thread
        left.start()
        left.join()
        assert gc.isenabled()
        gc.disable()
        with pause():
            pass
        assert not gc.isenabled()  # disabled before the pause: left disabled
        with pytest.raises(RuntimeError, match="without enter"):
            pause.leave()
    finally:
        (gc.enable if was else gc.disable)()
