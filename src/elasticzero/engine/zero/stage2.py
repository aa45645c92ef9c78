"""ZeRO stage 2: optimizer state and gradients sharded.

Held per rank (Ψ trainable elements, N ranks, fp32 Adam): parameters 4Ψ (views into flat fp32 buffers; the master
shard is a view into them), fp32 gradient shard 4Ψ/N, Adam state 8Ψ/N — 10 bytes/param at N=2 — plus transient bucket
buffers during backward (at most ``max_inflight + 1`` buckets of ``bucket_bytes``). bf16/fp16: 2Ψ compute params +
4Ψ/N master + 4Ψ/N grads + 8Ψ/N. Communication per step: reduce-scatter Ψ (overlapped with backward, bucket by
bucket as they fill) + all-gather Ψ (after ``step()``) = 2Ψ.

The fp32 gradient shards are allocated once and kept (as DeepSpeed's contiguous gradient partition): each step's
first reduction writes straight into them and ``zero_grad(set_to_none=True)`` only detaches them from the masters.
Allocating them anew every step cost the CPU a page fault per 4 KiB of fresh memory (on the engine bench's 30M GPT,
about 15k faults a step at 2 ranks). In a one-rank group the shard is the whole bucket, so stage 2 keeps its bucket
buffers as stage 1 does and reduces them in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elasticzero.engine.bucketer import GradBucketer
from elasticzero.engine.zero.flat import FlatBucket
from elasticzero.engine.zero.stage12 import _ReplicatedParamsZero


class ZeroStage2(_ReplicatedParamsZero):
    """ZeRO-2 optimizer wrapper (see :class:`~elasticzero.engine.zero.base.ZeroOptimizer` for the arguments).

    During backward each bucket is reduce-scattered as soon as it is complete (in the fixed flush order) and its full
    gradient buffer reused for the next bucket or freed; this rank accumulates only its fp32 shard (the master's
    ``.grad``, a tensor the next step's reduction writes again: copy it to keep it past ``zero_grad``).
    """

    stage = 2

    def __init__(self, module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        super().__init__(module, optimizer_class, **kwargs)
        self._grad_shards: dict[int, torch.Tensor] = {}  # bucket index -> its fp32 gradient shard, once allocated

    def _make_bucketer(self) -> GradBucketer:
        if self.world_size == 1:  # the shard is the whole bucket: stage 1's kept buffers, reduced in place
            return self._reduce_scatter_bucketer(keep_buffers=True)
        return self._reduce_scatter_bucketer(keep_buffers=False, shard_out=self._fresh_shard_out)

    def _grad_shard(self, bucket: FlatBucket) -> torch.Tensor:
        """The bucket's persistent fp32 gradient shard (allocated on first use)."""
        shard = self._grad_shards.get(bucket.index)
        if shard is None:
            shard = torch.empty(bucket.shard_numel, dtype=torch.float32, device=self.device)
            self._grad_shards[bucket.index] = shard
        return shard

    def _fresh_shard_out(self, bucket: FlatBucket) -> torch.Tensor | None:
        """The reduce-scatter's destination: the persistent shard for the step's first fp32 reduction (the master
        has no gradient), else a new tensor (added to the gradient, or cast into the shard)."""
        if self.home(bucket.index).host:  # lands in host memory: a transient device shard
            return None
        fresh = self.masters[bucket.index].grad is None
        return self._grad_shard(bucket) if fresh and self.policy.reduce_dtype == torch.float32 else None

    def _on_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        if self.bucketer.keep_buffers:
            self._reduced_into_kept_buffer(bucket, shard)
            return
        if self._land(bucket, shard):
            return
        master = self.masters[bucket.index]
        if master.grad is not None:
            master.grad.add_(shard)
            return
        grad = self._grad_shard(bucket)
        if grad is not shard:
            grad.copy_(shard)  # a low-precision reduction, cast up
        master.grad = grad

    def _held_grad_storage(self) -> list[torch.Tensor]:
        return list(self._grad_shards.values())
