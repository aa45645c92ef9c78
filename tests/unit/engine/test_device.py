"""Device placement of the ZeRO stages' buffers (one process, a world-size-1 gloo group).

Without a GPU only the CPU is real, so these tests check the rule rather than CUDA itself: every buffer an optimizer
holds is on ``opt.device``, the device of the parameters it serves (``_device_of``), and parameters spanning several
devices are refused at construction, before any collective.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import GradBucketer, LossScaler, ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.flat import _device_of
from elasticzero.errors import UsageError

pytestmark = pytest.mark.timeout(60)

STAGES: list[type[ZeroOptimizer]] = [ZeroStage1, ZeroStage2, ZeroStage3]


def _mixed() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[1].to("meta")
    return m


# -- _device_of ---------------------------------------------------------------------------------------------------
def test_device_of_one_device() -> None:
    ps = [torch.zeros(2), torch.ones(3, dtype=torch.bfloat16)]
    assert _device_of(ps) == torch.device("cpu")
    assert _device_of(iter([torch.empty(1, device="meta")])) == torch.device("meta")


def test_device_of_several_devices_raises() -> None:
    with pytest.raises(UsageError, match=r"share one device, found: cpu, meta"):
        _device_of([torch.zeros(2), torch.empty(2, device="meta")])


def test_device_of_no_params_raises() -> None:
    with pytest.raises(UsageError, match="found: none"):
        _device_of([])


# -- construction refuses mixed devices ------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.__name__)
def test_stage_refuses_params_on_several_devices(group: None, stage: type[ZeroOptimizer]) -> None:
    # sync_module_states=True (default) would broadcast first: a UsageError (not a gloo error on the meta tensor)
    # shows the check runs before any collective
    with pytest.raises(UsageError, match="share one device"):
        stage(_mixed(), torch.optim.SGD, lr=0.1)


def test_bucketer_refuses_bucket_on_several_devices(group: None) -> None:
    with pytest.raises(UsageError, match="share one device"):
        GradBucketer(_mixed().parameters())


# -- every buffer on the parameters' device -------------------------------------------------------------------------
def _held_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    held = list(opt.masters) + [m.grad for m in opt.masters if m.grad is not None]
    held += opt.bucketer.held_buffers()
    held += opt._flat  # the full flat buffers the parameters view
    held += [t for s in opt.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held += [p for b in opt.buckets for p in b.params]
    return held


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.__name__)
def test_buffers_on_param_device(group: None, stage: type[ZeroOptimizer], precision: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    device = next(model.parameters()).device
    opt = stage(model, torch.optim.AdamW, lr=1e-2, precision=precision)
    assert opt.device == device
    opt.bucketer.allocate_buffers()  # ZeRO-2/3 allocate lazily: check the allocation path too
    model(torch.randn(5, 8)).float().pow(2).sum().backward()
    scaler = LossScaler(init_scale=2.0**4)
    found = opt.unscale_(1.0)
    assert found.device == device and found.dtype == torch.float32
    assert not scaler.unscale_(opt)  # _agree on a flag from the optimizer
    assert opt.clip_grad_norm_(1.0).device == device
    assert opt.clip_grad_norm_(1.0, norm_type=float("inf")).device == device
    opt.step()
    held = _held_tensors(opt)
    assert len(held) > 3 * len(opt.buckets)
    assert {t.device for t in held} == {device}
    assert all(t.device == device for t in opt.full_state_dict().values())
    assert opt.memory_report()["total"] > 0
