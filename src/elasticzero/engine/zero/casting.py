"""Forward casting under a low-precision policy: the compute dtype of every parameter, the forward-input casts of
the module and the fp32 islands (modules the policy keeps in fp32)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from elasticzero.engine.precision import PrecisionPolicy


def compute_dtypes(module: nn.Module, policy: PrecisionPolicy) -> dict[int, torch.dtype]:
    """``id(param) -> compute dtype``: fp32 for parameters of modules the policy keeps in fp32 (a parameter shared
    with such a module too), else ``param_dtype``."""
    out: dict[int, torch.dtype] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if policy.keeps_fp32(m) or out.get(id(p)) == torch.float32:
                out[id(p)] = torch.float32
            else:
                out[id(p)] = policy.param_dtype
    return out


def keep_fp32_hooks(module: nn.Module, policy: PrecisionPolicy) -> list[Any]:
    """Under a low-precision policy: every module the policy keeps in fp32 gets its floating-point inputs cast up to
    fp32 and its floating-point outputs cast back down to ``param_dtype`` (handles, to remove them)."""
    if policy.param_dtype == torch.float32:
        return []
    handles = []
    down = _caster(policy.param_dtype)
    for m in module.modules():
        if isinstance(m, policy.fp32_modules):
            handles.append(m.register_forward_pre_hook(input_caster(torch.float32), with_kwargs=True))
            handles.append(m.register_forward_hook(lambda mod, args, out: tree_map(down, out)))
    return handles


def _caster(dtype: torch.dtype) -> Callable[[Any], Any]:
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return cast


def input_caster(dtype: torch.dtype) -> Callable[..., Any]:
    cast = _caster(dtype)

    def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
