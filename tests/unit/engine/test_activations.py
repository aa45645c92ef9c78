"""``checkpoint_activations``: which blocks it finds, where the saved inputs go, what it refuses, and that a wrapped
block computes what it did (no process group: the helper needs none)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from elasticzero.engine import checkpoint_activations
from elasticzero.engine.activations import (
    CheckpointedForward,
    HostSave,
    _without_cache,
    find_blocks,
    host_save_plan,
    repeated_block_type,
)
from elasticzero.errors import UsageError


class Layer(nn.Module):
    def __init__(self, width: int = 8, experts: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.out(torch.tanh(self.fc(x))) * scale
        return x + h + sum((e(x) for e in self.experts), torch.zeros_like(x))


class Net(nn.Module):
    def __init__(self, layers: int = 3, experts: int = 0) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # one class too, but smaller
        self.layers = nn.ModuleList(Layer(experts=experts) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return self.heads[0](x).sum() + self.heads[1](x).sum()


class EncoderDecoder(nn.Module):  # T5's shape: two stacks of one block class
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(Layer() for _ in range(2))
        self.decoder = nn.ModuleList(Layer() for _ in range(2))


def _names(model: nn.Module, blocks: object = None) -> list[str]:
    return [n for n, _ in find_blocks(model, blocks)]  # type: ignore[arg-type]


def test_the_repeated_blocks_are_the_largest_list_of_one_class() -> None:
    assert repeated_block_type(Net()) is Layer
    assert _names(Net()) == ["layers.0", "layers.1", "layers.2"]


def test_lists_inside_a_block_do_not_count_even_when_longer() -> None:
    model = Net(layers=2, experts=4)  # 4 experts per layer, 2 layers: still the layers (2 heads: fewer parameters)
    assert _names(model) == ["layers.0", "layers.1"]


def test_every_module_of_the_block_class_is_taken_in_every_stack() -> None:
    assert _names(EncoderDecoder()) == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]


def test_blocks_given_as_class_predicate_or_modules_outermost_only() -> None:
    model = Net()
    assert _names(model, nn.Linear) == ["embed", "heads.0", "heads.1", "layers.0.fc", "layers.0.out", "layers.1.fc",
                                        "layers.1.out", "layers.2.fc", "layers.2.out"]  # fmt: skip
    assert _names(model, (Layer, nn.Linear))[:3] == ["embed", "heads.0", "heads.1"]
    assert _names(model, (Layer, nn.Linear))[3:] == ["layers.0", "layers.1", "layers.2"]  # not their Linears
    assert _names(model, lambda m: m is model.layers[1]) == ["layers.1"]
    assert _names(model, model.layers) == ["layers.0", "layers.1", "layers.2"]
    assert _names(model, model.layers[2]) == ["layers.2"]
    assert _names(model, [model.layers[0], model.embed]) == ["embed", "layers.0"]


def test_nothing_to_checkpoint_is_one_line() -> None:
    with pytest.raises(
        UsageError, match=r"Sequential: no nn.ModuleList of identical blocks to checkpoint; pass blocks="
    ):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(UsageError, match=r"Net: no module matches blocks=<class 'torch.nn.modules.conv.Conv1d'>"):
        find_blocks(Net(), nn.Conv1d)
    with pytest.raises(UsageError, match=r"no module matches blocks=the predicate"):
        find_blocks(Net(), lambda m: False)


def test_a_block_is_checkpointed_once() -> None:
    model = Net()
    assert checkpoint_activations(model) == ["layers.0", "layers.1", "layers.2"]
    with pytest.raises(UsageError, match=r"layers.0: its forward is checkpointed already"):
        checkpoint_activations(model)
    hf_style = Net()
    hf_style.layers[1].gradient_checkpointing = True  # what transformers' activation_checkpointing_enable sets
    with pytest.raises(UsageError, match=r"layers.1: Hugging Face activation checkpointing is on for it"):
        checkpoint_activations(hf_style)
    assert "forward" not in hf_style.layers[0].__dict__  # refused before any block was wrapped


def test_saved_inputs_go_to_host_memory_only_from_an_accelerator() -> None:
    assert host_save_plan(False, "cuda") is None
    assert host_save_plan(True, "cpu") is None  # already in host memory: save_on_cpu would only copy them
    assert host_save_plan(True, None) is None  # no tensor input
    assert host_save_plan(True, "cuda") == HostSave(pin_memory=True, device_type="cuda")
    assert host_save_plan(True, "xpu") == HostSave(pin_memory=False, device_type="xpu")


def test_a_checkpointed_call_turns_the_key_value_cache_off() -> None:
    cache = object()
    kwargs = {"past_key_values": cache, "use_cache": True, "attention_mask": None}
    assert _without_cache(kwargs, keep_cache=False) == {"past_key_values": None, "use_cache": False,
                                                         "attention_mask": None}  # fmt: skip
    assert _without_cache(kwargs, keep_cache=True) == {"past_key_values": cache, "use_cache": False,
                                                        "attention_mask": None}  # fmt: skip
    assert kwargs["use_cache"] is True  # the caller's dict is not changed
    plain = {"layer_past": None, "use_cache": False}
    assert _without_cache(plain, keep_cache=False) is plain


@pytest.mark.parametrize("cpu", [False, True])
def test_wrapped_blocks_compute_the_same_keep_their_names_and_copy(cpu: bool) -> None:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    checkpoint_activations(model, cpu=cpu)
    assert isinstance(model.layers[0].__dict__["forward"], CheckpointedForward)
    assert model.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(5, 8, requires_grad=True)
    kept: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        loss = model(x)
    loss.backward()
    ref(x).backward()
    assert torch.Size([5, 32]) not in kept  # the layers' 4x-wide interior is recomputed, not kept
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad), name  # the recompute repeats the same kernels on the same inputs
    twin = copy.deepcopy(model)  # the wrapper follows the copy: it runs the copy's own forward
    assert twin.layers[0].forward.forward.__self__ is twin.layers[0]  # type: ignore[union-attr]
    with torch.no_grad():  # no graph: the block runs plainly
        assert torch.equal(twin(x), ref(x))
