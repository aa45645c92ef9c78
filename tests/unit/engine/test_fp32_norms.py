"""Low-precision policies keep norm layers with running statistics (BatchNorm) in fp32 (one process, a world-size-1
gloo group): before, the first bf16/fp16 forward of a BatchNorm network failed on every stage with ``expected scalar
type BFloat16 but found Float`` (bf16 weight views meeting fp32 running statistics)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.precision import PrecisionPolicy
from elasticzero.engine.zero.base import ZeroOptimizer

pytestmark = pytest.mark.timeout(60)

STAGES: list[type[ZeroOptimizer]] = [ZeroStage1, ZeroStage2, ZeroStage3]
BF16 = PrecisionPolicy.from_name("bf16")


def _convnet() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10), nn.LayerNorm(10)
    )


def _train(model: nn.Module, stage: type[ZeroOptimizer], precision: str | PrecisionPolicy) -> list[float]:
    model(torch.randn(2, 3, 8, 8))  # materialise the LazyLinear before wrapping
    opt = stage(model, torch.optim.AdamW, lr=1e-2, precision=precision)
    torch.manual_seed(1)
    losses = []
    for _ in range(3):
        out = model(torch.randn(4, 3, 8, 8))
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.__name__)
def test_batchnorm_trains_in_low_precision(group: None, stage: type[ZeroOptimizer], precision: str) -> None:
    model = _convnet()
    losses = _train(model, stage, precision)
    ref = _train(_convnet(), stage, "fp32")
    assert losses == pytest.approx(ref, rel=5e-2)
    bn: nn.BatchNorm2d = model[1]  # type: ignore[assignment]
    assert bn.running_mean is not None and bn.num_batches_tracked is not None
    assert bn.running_mean.dtype == torch.float32 and bn.num_batches_tracked.item() == 4
    if stage is not ZeroStage3:  # stage 3 holds freed views between uses
        assert bn.weight.dtype == torch.float32 and model[0].weight.dtype == getattr(
            torch, {"bf16": "bfloat16"}.get(precision, "float16")
        )


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.__name__)
def test_fp32_module_boundary_casts(group: None, stage: type[ZeroOptimizer]) -> None:
    model = _convnet()
    model(torch.randn(2, 3, 8, 8))
    policy = PrecisionPolicy(torch.bfloat16, fp32_modules=(nn.BatchNorm2d, nn.LayerNorm))
    stage(model, torch.optim.AdamW, precision=policy)
    seen: dict[str, torch.dtype] = {}
    for name, m in model.named_children():
        m.register_forward_hook(lambda mod, args, out, name=name: seen.update({name: (args[0].dtype, out.dtype)}))
    out = model(torch.randn(4, 3, 8, 8))
    # norm layers see fp32 inputs (hooks registered later see the output already cast back down for the next layer)
    assert seen["1"] == (torch.float32, torch.bfloat16) and seen["2"] == (torch.bfloat16, torch.bfloat16)
    assert seen["5"] == (torch.float32, torch.bfloat16) and out.dtype == torch.bfloat16
    assert policy.keeps_fp32(model[5]) and not BF16.keeps_fp32(model[5]) and BF16.keeps_fp32(model[1])


def test_empty_fp32_modules_runs_batchnorm_in_low_precision(group: None) -> None:
    model = _convnet()
    model(torch.randn(2, 3, 8, 8))
    ZeroStage2(model, torch.optim.AdamW, precision=PrecisionPolicy(torch.bfloat16, fp32_modules=()))
    assert model[1].weight.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="expected scalar type"):  # why BatchNorm is fp32 by default
        model(torch.randn(4, 3, 8, 8))


def test_frozen_norm_params_stay_fp32(group: None) -> None:
    model = _convnet()
    model(torch.randn(2, 3, 8, 8))
    model[1].requires_grad_(False)
    ZeroStage1(model, torch.optim.AdamW, precision="bf16")
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    model(torch.randn(4, 3, 8, 8)).float().sum().backward()
