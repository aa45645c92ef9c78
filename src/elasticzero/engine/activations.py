"""Activation checkpointing of a model's repeated blocks, through torch's own ``torch.utils.checkpoint``.

::

    from elasticzero.engine import checkpoint_activations

    checkpoint_activations(model)                        # the repeated blocks (transformer layers), found in the model
    checkpoint_activations(model, blocks=LlamaDecoderLayer, cpu=True)   # a class, a predicate or the modules themselves

Each block's ``forward`` runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its forward keeps
only the block's inputs, and its backward runs the block again to get the activations back (one extra forward per
block). With ``cpu=True`` the kept inputs live in host memory (torch's ``torch.autograd.graph.save_on_cpu``, pinned
for CUDA) until the backward, as DeepSpeed's ``cpu_checkpointing`` does; activations already on the CPU stay where
they are.

The block's own ``forward`` is wrapped on the instance (an attribute beside the class's method), not its
``__call__``: module hooks (ZeRO stage 3's gathers, FSDP2's) stay outside the checkpoint and run once per call, as
Hugging Face's ``GradientCheckpointingLayer`` does it; parameter names and state dicts are unchanged. Under
``torch.no_grad()`` a block runs plainly. A checkpointed call drops the key/value cache a Hugging Face layer was
given (``use_cache=False``, ``past_key_values=None``; a recompute would write it a second time), as Hugging Face's
own checkpointing does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from elasticzero.errors import UsageError

__all__ = ["BlockSpec", "HostSave", "checkpoint_activations", "find_blocks", "host_save_plan", "repeated_block_type"]


_Classes: TypeAlias = "type[nn.Module] | tuple[type[nn.Module], ...]"
BlockSpec: TypeAlias = "_Classes | Callable[[nn.Module], bool] | nn.Module | Iterable[nn.Module] | None"

# keyword arguments through which Hugging Face layers read and write their key/value cache
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


@dataclass(frozen=True)
class HostSave:
    """Where a checkpointed block's saved inputs wait for the backward: host memory, pinned or not, copied back to
    ``device_type`` (the arguments of ``torch.autograd.graph.save_on_cpu``)."""

    pin_memory: bool
    device_type: str


def host_save_plan(cpu: bool, device_type: str | None) -> HostSave | None:
    """Whether a block's saved inputs on ``device_type`` move to host memory: None keeps them where they are (no
    ``cpu``; already on the CPU, where ``save_on_cpu`` would only copy them; no tensor input). Pinned for CUDA, so the
    copies can run asynchronously."""
    if not cpu or device_type in (None, "cpu", "meta"):
        return None
    return HostSave(pin_memory=device_type == "cuda", device_type=device_type)


def _saving(plan: HostSave | None) -> AbstractContextManager[Any]:
    if plan is None:
        return nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=plan.pin_memory, device_type=plan.device_type)


def _first_device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The device of the first tensor argument: where the block's activations are."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def _without_cache(kwargs: dict[str, Any], keep_cache: bool) -> dict[str, Any]:
    """``kwargs`` with a Hugging Face layer's cache off, as Hugging Face's own checkpointing does (a new dict):
    ``use_cache=False``, and no cache passed unless the layer only reads it (``keep_cache``)."""
    dropped: dict[str, Any] = {} if keep_cache else {k: None for k in _CACHE_KWARGS if kwargs.get(k) is not None}
    if kwargs.get("use_cache"):
        dropped["use_cache"] = False
    return {**kwargs, **dropped} if dropped else kwargs


class CheckpointedForward:
    """A block's ``forward`` run through ``torch.utils.checkpoint`` (non-reentrant); set as the block's instance
    attribute ``forward`` by :func:`checkpoint_activations`."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], cpu: bool) -> None:
        self.forward, self.cpu = forward, cpu
        self._keep_cache = bool(getattr(module, "_can_checkpoint_with_cache", False))  # HF: a layer that only reads it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        kwargs = _without_cache(kwargs, self._keep_cache)
        with _saving(host_save_plan(self.cpu, _first_device_type(args, kwargs))):
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def repeated_block_type(model: nn.Module) -> type[nn.Module]:
    """The class of ``model``'s repeated blocks: the children of its largest ``nn.ModuleList`` whose children are all
    of one class (transformer layers: GPT's ``blocks``, Llama's ``model.layers``, GPT-2's ``transformer.h``), lists
    inside such a block (a layer's experts) not counted; on a tie in length, the one with more parameters."""
    lists = [m for m in _outermost(model, _is_uniform_list) if isinstance(m, nn.ModuleList)]
    if not lists:
        raise UsageError(
            f"{type(model).__name__}: no nn.ModuleList of identical blocks to checkpoint; pass blocks= (a block class, "
            "a predicate or the modules)"
        )
    best = max(lists, key=lambda lst: (len(lst), sum(p.numel() for p in lst.parameters())))
    return type(best[0])


def _is_uniform_list(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1


def _outermost(model: nn.Module, pred: Callable[[nn.Module], bool]) -> Iterator[nn.Module]:
    """Modules of ``model`` (itself included) for which ``pred`` holds, none inside another one that was chosen."""
    yield from (m for _, m in _outermost_named(model, pred))


def _outermost_named(model: nn.Module, pred: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Module]]:
    chosen: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{c}.") or c == "" for c in chosen):
            continue
        if pred(module):
            chosen.append(name)
            yield name, module


def _predicate(model: nn.Module, blocks: BlockSpec) -> Callable[[nn.Module], bool]:
    if blocks is None:
        blocks = repeated_block_type(model)
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        classes = blocks
        return lambda m: isinstance(m, classes)
    if isinstance(blocks, nn.ModuleList):
        blocks = list(blocks)
    if isinstance(blocks, nn.Module):
        blocks = [blocks]
    if callable(blocks):
        return blocks
    ids = {id(m) for m in blocks}
    return lambda m: id(m) in ids


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` blocks :func:`checkpoint_activations` wraps: ``blocks`` is None (every module of
    :func:`repeated_block_type`), a class or tuple of classes, a predicate ``f(module) -> bool``, or the modules (one,
    an ``nn.ModuleList`` or any iterable). Only the outermost matches count (a block is never checkpointed inside
    another). Raises :class:`UsageError` when nothing matches or a block is checkpointed already."""
    found = list(_outermost_named(model, _predicate(model, blocks)))
    if not found:
        what = "the predicate" if callable(blocks) and not isinstance(blocks, (type, nn.Module)) else repr(blocks)
        raise UsageError(f"{type(model).__name__}: no module matches blocks={what}; nothing to checkpoint")
    for name, module in found:
        _check_not_checkpointed(name or type(model).__name__, module)
    return found


def _check_not_checkpointed(name: str, module: nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), CheckpointedForward):
        raise UsageError(f"{name}: its forward is checkpointed already (checkpoint_activations ran on it)")
    if getattr(module, "gradient_checkpointing", False):
        raise UsageError(
            f"{name}: Hugging Face activation checkpointing is on for it; call "
            "model.activation_checkpointing_disable() (gradient_checkpointing_disable() before transformers 5) or "
            "drop activation_checkpointing from the config"
        )
    if "forward" in module.__dict__:
        raise UsageError(f"{name}: its forward is replaced on the instance already (another wrapper); pass blocks=")


def checkpoint_activations(model: nn.Module, blocks: BlockSpec = None, *, cpu: bool = False) -> list[str]:
    """Checkpoint the activations of ``model``'s blocks (see :func:`find_blocks` for ``blocks``); with ``cpu``, keep
    their saved inputs in host memory until the backward. Returns the names of the blocks wrapped. Composes with every
    ZeRO stage (wrap before or after building it) and with ``torch.compile`` (per block or whole model)."""
    found = find_blocks(model, blocks)
    for _, module in found:
        module.forward = CheckpointedForward(module, module.forward, cpu)
    names = [name or "<root>" for name, _ in found]
    logging.getLogger(__name__).info(
        "activation checkpointing (cpu=%s) on %d %s blocks", cpu, len(names), type(found[0][1]).__name__
    )
    return names
