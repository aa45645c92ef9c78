"""ZeroStage3: a submodule called directly (not through the root's forward) gathers what it needs (one process, a
world-size-1 gloo group). Before, ``model.encoder(x)`` on a non-unit ``encoder`` ran on freed parameters and failed
with a raw ``setStorage: ... out of bounds for storage of size 0`` (HF encoder-decoder ``generate()`` calls
``model.get_encoder()(...)`` first, so T5 could not generate on stage 3)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from elasticzero import ZeroStage3

pytestmark = pytest.mark.timeout(60)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class EncDec(nn.Module):
    """An embedding shared by the encoder, the decoder and the head (so the root owns it), non-unit stacks."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 8)
        self.encoder = nn.ModuleDict({"embed": self.shared, "blocks": nn.ModuleList([Block(), Block()])})
        self.encoder_norm = nn.LayerNorm(8)
        self.decoder = nn.ModuleList([Block()])
        self.encoder_forward = Encoder(self)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder["embed"](ids)
        for b in self.encoder["blocks"]:
            h = b(h)
        return self.encoder_norm(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder_forward(ids)
        for b in self.decoder:
            h = b(h)
        return h @ self.shared.weight.t()


class Encoder(nn.Module):
    """A parameterless entry point over modules registered elsewhere (like HF's ``get_encoder()`` objects)."""

    def __init__(self, owner: EncDec) -> None:
        super().__init__()
        self.embed, self.blocks, self.norm = owner.encoder["embed"], owner.encoder["blocks"], owner.encoder_norm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


def _model() -> EncDec:
    torch.manual_seed(0)
    return EncDec()


# World size 1: ZeroStage3 runs the reference's very forward and backward kernels on the same values; only the SGD
# step runs on a flat buffer instead of per-parameter tensors, where a kernel's vector body and scalar tail may round
# an element's multiply-add differently: at most 1 ulp (2^-23 relative) per step per element. 2 steps: 1e-6 relative
# (8 ulps) and 1e-7 absolute for elements near zero (an ulp of the ~0.1-sized updates) hold on any CPU.
RTOL, ATOL = 1e-6, 1e-7


def _freed(opt: ZeroStage3) -> bool:
    return all(full.untyped_storage().size() == 0 for full in opt._flat)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_direct_submodule_calls_after_training(group: None, reshard: bool) -> None:
    model, ref = _model(), _model()
    opt = ZeroStage3(model, torch.optim.AdamW, lr=1e-2, reshard_after_forward=reshard)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids = torch.randint(0, 16, (4, 5))
    for m, o in ((model, opt), (ref, ref_opt)):
        m(ids).pow(2).mean().backward()
        o.step()
        o.zero_grad()
    assert _freed(opt)
    with torch.no_grad():
        torch.testing.assert_close(model.encoder_forward(ids), ref.encoder_forward(ids))
        torch.testing.assert_close(model.encoder["embed"](ids), ref.shared(ids))
        torch.testing.assert_close(
            model.encoder["blocks"][1](torch.ones(2, 8)), ref.encoder["blocks"][1](torch.ones(2, 8))
        )
        torch.testing.assert_close(model.encoder_norm(torch.ones(2, 8)), ref.encoder_norm(torch.ones(2, 8)))
    assert _freed(opt)
    torch.testing.assert_close(model(ids), ref(ids))  # the root forward is unaffected (and records its order once)


def test_training_through_a_direct_call(group: None) -> None:
    model, ref = _model(), _model()
    # SGD: the decoder gets no gradient in the reference but a zero one here (decay would move it)
    opt = ZeroStage3(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = torch.randint(0, 16, (4, 5))
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            m.encoder_forward(ids).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        assert _freed(opt)
    full = opt.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=RTOL, atol=ATOL, msg=k)


def test_direct_call_with_activation_checkpointing(group: None) -> None:
    model, ref = _model(), _model()
    opt = ZeroStage3(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = torch.randint(0, 16, (4, 5))
    for m, o in ((model, opt), (ref, ref_opt)):
        h = torch.utils.checkpoint.checkpoint(m.encoder_forward, ids, use_reentrant=False)
        h.sum().backward()
        o.step()
    full = opt.full_state_dict()
    for k, v in copy.deepcopy(ref).state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=RTOL, atol=ATOL, msg=k)


class CrossCall(nn.Module):
    """The root's forward calls a layer inside another unit without going through that unit's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1].fc(self.blocks[0](x))


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_layer_of_another_unit_called_inside_a_forward(group: None, reshard: bool) -> None:
    model, ref = CrossCall(), CrossCall()
    opt = ZeroStage3(model, torch.optim.SGD, lr=0.1, reshard_after_forward=reshard)
    assert sorted(set(opt.unit_of_bucket().values())) == ["blocks.0", "blocks.1"]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        assert _freed(opt)
    full = opt.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=RTOL, atol=ATOL)


class Probe(Block):
    """Records how many forward hooks its layer carries while the block's own forward runs."""

    seen: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(len(self.fc._forward_pre_hooks) + len(self.fc._forward_hooks))
        return super().forward(x)


def test_a_units_submodules_carry_no_hooks_while_it_runs(group: None) -> None:
    """torch.compile per block: a hooked submodule inside a compiled block splits its graph and recompiles the
    block's code once per block (its hook ids differ), so a unit's forward detaches its interior's entry hooks and
    re-attaches them after (a direct call between steps still gathers)."""
    torch.manual_seed(0)
    model = nn.Sequential(Probe(), Probe())
    for probe in model:
        probe.seen = []
    opt = ZeroStage3(model, torch.optim.SGD, lr=0.1, units=Probe)
    hooks = [len(p.fc._forward_pre_hooks) + len(p.fc._forward_hooks) for p in model]
    assert hooks == [2, 2]  # entry points: a direct call of `fc` gathers its block's bucket
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    assert [p.seen for p in model] == [[0, 0], [0, 0]]
    assert [len(p.fc._forward_pre_hooks) + len(p.fc._forward_hooks) for p in model] == hooks
    full = opt.full_state_dict()
    with torch.no_grad():  # the direct call between steps gathered the block's bucket, and freed it again
        torch.testing.assert_close(
            model[1].fc(torch.ones(2, 8)), torch.ones(2, 8) @ full["1.fc.weight"].t() + full["1.fc.bias"]
        )
    assert _freed(opt)
