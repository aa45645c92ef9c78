"""The engine's hold on the module's parameters (``zero/bindings.py``) and the gradient stand-ins (``zero/standin.py``),
piece by piece and on a world-1 ZeRO optimizer: conversions that keep device and dtype are followed, others refused
before anything changes; a rebound parameter is put back and named; torch's clip over a ZeRO module raises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine.zero.bindings import Change, call_name, conversion_change, hidden
from elasticzero.engine.zero.standin import GradStandIns, ShardedGrad
from elasticzero.errors import UsageError

STAGES = [ZeroStage1, ZeroStage2, ZeroStage3]


class _Recorder(nn.Module):
    """Keeps the ``fn`` torch's public conversion methods hand to ``_apply``."""

    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> _Recorder:
        self.fn = fn
        return self


def _fn_of(method: Callable[[nn.Module], Any]) -> Any:
    rec = _Recorder()
    method(rec)
    return rec.fn


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.LayerNorm(2))
    model[3].requires_grad_(False)  # a frozen layer: converted as torch converts it when a conversion is followed
    return model


# -- pure parts -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "want"),
    [
        (lambda m: m.to(torch.device("cpu", 0)), None),  # a copy (the HF Trainer's move), same device and dtype
        (lambda m: m.cpu(), None),
        (lambda m: m.float(), None),
        (lambda m: m.to(torch.float64), Change("convert", "torch.float32", "torch.float64")),
        (lambda m: m.half(), Change("convert", "torch.float32", "torch.float16")),
        (lambda m: m.to("meta"), Change("move", "cpu", "meta")),
    ],
)
def test_a_conversion_is_judged_on_probes(method: Callable[[nn.Module], Any], want: Change | None) -> None:
    params = [nn.Parameter(torch.zeros(3))]
    assert conversion_change(_fn_of(method), params) == want


def test_the_call_is_named_after_torchs_method() -> None:
    assert call_name(nn.Linear(1, 1), _fn_of(lambda m: m.half())) == "Linear.half()"
    assert call_name(nn.Linear(1, 1), _fn_of(lambda m: m.to(torch.float64))) == "Linear.to()"
    assert call_name(nn.Linear(1, 1), lambda t: t) == "Linear._apply()"


def test_hidden_parameters_come_back_in_order_after_an_error() -> None:
    from elasticzero.engine.zero.bindings import Binding

    lin = nn.Linear(2, 2)
    binding = Binding("weight", lin, "weight", lin.weight, lin.weight.detach().view(-1), 0)
    with pytest.raises(RuntimeError), hidden([binding]):
        assert lin._parameters["weight"] is None
        raise RuntimeError("fn failed")
    assert list(lin._parameters) == ["weight", "bias"] and lin._parameters["weight"] is binding.param


def test_a_stand_in_grad_refuses_torchs_clip_and_any_op() -> None:
    p = nn.Parameter(torch.ones(2, 3))
    stand_ins = GradStandIns([("w", p)], "ZeroStage2")
    stand_ins.post()
    assert isinstance(p.grad, ShardedGrad) and p.grad.shape == p.shape
    with pytest.raises(UsageError, match=r"opt\.clip_grad_norm_\(max_norm\)"):
        torch.nn.utils.clip_grad_norm_([p], 1.0)
    with pytest.raises(UsageError, match=r"aten\.clamp"):
        torch.nn.utils.clip_grad_value_([p], 1.0)
    assert "ZeroStage2's shards" in repr(p.grad)
    stand_ins.lift()
    assert p.grad is None


def test_a_real_gradient_is_never_replaced_or_lifted() -> None:
    p = nn.Parameter(torch.ones(2))
    stand_ins = GradStandIns([("w", p)], "ZeroStage1")
    p.grad = torch.full((2,), 3.0)
    stand_ins.post()
    stand_ins.lift()
    assert torch.equal(p.grad, torch.full((2,), 3.0))


# -- on a ZeRO optimizer (world 1) --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", STAGES)
def test_a_same_device_copy_is_followed(group: None, cls: type) -> None:
    model = _model()
    opt = cls(model, torch.optim.SGD, lr=0.1)
    frozen = model[3].weight
    model.to(torch.device("cpu", 0))  # copies every tensor torch converts
    opt._bindings.check("test")  # every managed parameter still the engine's view
    assert model[3].weight is frozen and model[3].weight.dtype == torch.float32


@pytest.mark.parametrize("cls", STAGES)
def test_a_dtype_conversion_is_refused_before_anything_changes(group: None, cls: type) -> None:
    model = _model()
    opt = cls(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(UsageError, match=r"^ZeroStage\d: Sequential\.double\(\) would convert the parameters"):
        model.double()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the frozen LayerNorm too: nothing converted
    opt._bindings.check("test")


@pytest.mark.parametrize("cls", STAGES)
def test_a_rebound_parameter_is_put_back_and_named(group: None, cls: type) -> None:
    model = _model()
    opt = cls(model, torch.optim.SGD, lr=0.1)
    model[0].weight.data = torch.zeros(8, 4)
    with pytest.raises(UsageError, match=r"Sequential\.forward found 0\.weight rebound"):
        model(torch.ones(1, 4))
    model(torch.ones(1, 4)).sum().backward()  # put back: the next forward is the engine's again
    opt.step()
    assert not torch.equal(opt.full_state_dict()["0.weight"], torch.zeros(8, 4))


@pytest.mark.parametrize("cls", STAGES)
def test_torchs_clip_on_the_module_raises_and_the_engines_clip_works(group: None, cls: type) -> None:
    model = _model()
    opt = cls(model, torch.optim.SGD, lr=0.1)
    model(torch.ones(3, 4)).square().sum().backward()
    with pytest.raises(UsageError, match=r"gradient lives in ZeroStage\d's shards"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert float(opt.clip_grad_norm_(1.0)) > 0
    assert opt.memory_report()["total"] > 0  # the stand-ins hold no storage and are not counted
    model(torch.ones(3, 4))  # the next forward takes the stand-ins down
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("cls", STAGES)
def test_ddp_around_a_zero_module_raises_before_reading_a_parameter(group: None, cls: type) -> None:
    model = _model()
    model._ddp_params_and_buffers_to_ignore = ["a.buffer"]  # the user's own list is kept
    cls(model, torch.optim.SGD, lr=0.1)
    assert set(model._ddp_params_and_buffers_to_ignore) == {"a.buffer", "0.weight", "0.bias", "2.weight", "2.bias"}
    with pytest.raises(RuntimeError, match="DistributedDataParallel is not needed"):
        torch.nn.parallel.DistributedDataParallel(model)
