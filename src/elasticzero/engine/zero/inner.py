"""The wrapped optimizer of a ZeRO stage: its parameter groups (the user's, mapped to the masters) and the keyword
arguments it is built with (fused by default)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from elasticzero.errors import UsageError


def optimizer_kwargs_for(optimizer_class: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments the wrapped optimizer is built with: ``kwargs`` plus ``fused=True`` when the caller chose
    neither ``fused`` nor ``foreach`` and ``optimizer_class`` takes ``fused``.

    Why: the masters are a few large flat fp32 tensors (one per bucket), so a fused optimizer updates each in one
    element-wise pass with no temporaries, where torch's default on the CPU (a loop of single-tensor ops) makes about
    ten passes and allocates two master-sized temporaries per bucket and step (``sqrt``, ``div``). The update is the
    same element-wise math (within fp32 rounding of torch's other implementations; fused on a flat master equals
    fused on the separate parameters bitwise)."""
    chosen = "fused" in kwargs or "foreach" in kwargs
    takes_fused = "fused" in inspect.signature(optimizer_class).parameters
    return dict(kwargs) if chosen or not takes_fused else {**kwargs, "fused": True}


def build_optimizer(
    optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]], kwargs: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """``optimizer_class(groups, **optimizer_kwargs_for(...))``; where torch refuses the fused default (no fused
    kernel for this device, ``differentiable=True``), the caller's own ``kwargs`` as they are."""
    wanted = optimizer_kwargs_for(optimizer_class, kwargs)
    if wanted.keys() == kwargs.keys():
        return optimizer_class(groups, **kwargs)
    try:  # copies: torch fills each group dict with the defaults it was given, even when it then refuses them
        return optimizer_class([dict(g) for g in groups], **wanted)
    except RuntimeError:  # torch: "`fused=True` requires ...", "`fused` does not support `differentiable`"
        return optimizer_class([dict(g) for g in groups], **kwargs)


def assign_groups(
    named: list[tuple[str, nn.Parameter]], param_groups: Sequence[dict[str, Any]] | None
) -> tuple[dict[nn.Parameter, int], list[dict[str, Any]]]:
    """Map every trainable parameter to its group index; return the groups' options (without ``params``)."""
    if param_groups is None:
        return {p: 0 for _, p in named}, [{}]
    group_of: dict[nn.Parameter, int] = {}
    options = []
    for gi, g in enumerate(param_groups):
        options.append({k: v for k, v in g.items() if k != "params"})
        for p in g["params"]:
            if p in group_of:
                raise UsageError(f"a parameter appears in param_groups {group_of[p]} and {gi}")
            group_of[p] = gi
    missing = [n for n, p in named if p not in group_of]
    if missing:
        raise UsageError(f"trainable parameters missing from param_groups: {', '.join(missing[:5])}")
    return group_of, options
