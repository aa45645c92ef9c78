"""``param.grad`` of a managed parameter while the engine holds its gradient: a stand-in that refuses every use.

Every loop and framework clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (the HF
``Trainer`` through accelerate, Lightning's precision plugin). Under ZeRO the gradients live in the engine's shards and
``param.grad`` is None, so torch's clip found no gradient, returned 0.0 and clipped nothing — silently. Torch's own
clip could only compute the true norm if ``param.grad`` were a sharded tensor type whose norm reduces over ranks
(FSDP2's DTensor gradients); the engine's shards cut parameters at any flat offset, which no DTensor placement
expresses, and a home-made type would have to answer every op any code applies to a gradient. So the engine makes the
call fail loudly instead: after every backward, each managed parameter without a gradient gets a
:class:`ShardedGrad` (no storage, the parameter's shape, dtype and device) whose every op raises one line naming the
fix, ``opt.clip_grad_norm_(max_norm)`` (the global norm over every rank's shards). The stand-ins go at
``zero_grad()`` and before the next forward, so they never meet autograd's accumulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from elasticzero.errors import UsageError


class ShardedGrad(torch.Tensor):
    """``param.grad`` of a parameter whose gradient a ZeRO optimizer holds in its shards: any op on it raises."""

    param_name: str
    owner: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, owner: str) -> ShardedGrad:
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        t.param_name, t.owner = name, owner
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        stand_in = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedGrad))
        raise UsageError(refused_use(stand_in.owner, stand_in.param_name, str(func)))

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedGrad({self.param_name!r}: the gradient lives in {self.owner}'s shards)"


def refused_use(owner: str, name: str, op: str) -> str:
    """The one line for an op on a stand-in gradient (torch's clip reaches it as ``aten.linalg_vector_norm``)."""
    return (
        f"{owner}: {op} on {name}.grad, but the gradient lives in {owner}'s shards (param.grad is a stand-in): "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) would see nothing and clip nothing; clip with "
        "opt.clip_grad_norm_(max_norm) (the global norm over every rank's shards), read gradients with "
        "opt.grad_pieces()"
    )


class GradStandIns:
    """One :class:`ShardedGrad` per managed parameter, posted as ``param.grad`` after each backward and lifted before
    the next forward and at ``zero_grad``."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], owner: str) -> None:
        self._pairs = [(p, ShardedGrad(p, name, owner)) for name, p in named]

    def post(self) -> None:
        """Each managed parameter without a gradient gets its stand-in."""
        for p, g in self._pairs:
            if p.grad is None:
                p.grad = g

    def lift(self) -> None:
        """Every stand-in still posted is taken down (``param.grad`` None again)."""
        for p, g in self._pairs:
            if p.grad is g:
                p.grad = None


def is_stand_in(t: Any) -> bool:
    """Whether ``t`` is a stand-in gradient (no storage: memory reports skip it)."""
    return isinstance(t, ShardedGrad)
