"""Global gradient norm over sharded gradients (one scalar all-reduce) and in-place clipping."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elasticzero.engine.zero.comm.communicator import Communicator


def local_norm_term(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """This rank's contribution: ``max |g|`` for the inf-norm, else ``sum |g|^p`` (fp32, 0-dim, on ``device``).

    Computed like ``torch.nn.utils.clip_grad_norm_``: one norm per tensor, then the norm of those norms (pass one
    tensor per parameter, not a whole flat shard: a single fp32 norm over millions of elements loses ~1e-4 relative).
    """
    grads = [g.detach().float() for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    total = torch.nn.utils.get_total_norm(grads, norm_type).to(device)
    return total if math.isinf(norm_type) else total**norm_type


def global_grad_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float,
    communicator: Communicator,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The norm of all ranks' shards together: one scalar all-reduce (MAX for inf, else SUM) on ``device`` (the
    gradients' device: nccl reduces only CUDA tensors)."""
    term = local_norm_term(grads, norm_type, device)
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    communicator.all_reduce(term, op=op, tag="norm")
    return term if math.isinf(norm_type) else term ** (1.0 / norm_type)


def clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` (torch's formula), a 0-dim tensor like ``total_norm``."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def scale_by_(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the 0-dim tensor ``coef`` (moved to each gradient's device and dtype: offloaded
    shards live in host memory)."""
    for g in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))


def clip_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by :func:`clip_coef`."""
    scale_by_(grads, clip_coef(max_norm, total_norm))


def unscale_and_check_(
    grads: Sequence[torch.Tensor], inv_scale: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; 0-dim fp32 tensor on ``device``, 1.0 if any local inf/NaN else
    0.0 (a shard in host memory, offloaded, is checked there)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        g.mul_(inv_scale)
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().to(found.device))
    return found
