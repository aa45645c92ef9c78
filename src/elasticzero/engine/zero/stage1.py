"""ZeRO stage 1: optimizer state sharded; every rank keeps the full gradient.

Held per rank (Ψ trainable elements, N ranks, fp32 Adam): parameters 4Ψ (the module's parameters are views into flat
fp32 buffers; the master shard is a view into them), full gradient buffers 4Ψ (persistent, ``reduce_dtype``), Adam
``exp_avg``/``exp_avg_sq`` 8Ψ/N — 12 bytes/param at N=2. bf16/fp16: 2Ψ compute params + 4Ψ/N master + 4Ψ grads +
8Ψ/N. Communication per step: reduce-scatter Ψ (at the end of backward, bucket by bucket) + all-gather Ψ (after
``step()``) = 2Ψ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elasticzero.engine.bucketer import GradBucketer
from elasticzero.engine.zero.flat import FlatBucket
from elasticzero.engine.zero.stage12 import _ReplicatedParamsZero


class ZeroStage1(_ReplicatedParamsZero):
    """ZeRO-1 optimizer wrapper (see :class:`~elasticzero.engine.zero.base.ZeroOptimizer` for the arguments).

    Gradients accumulate into persistent full-size bucket buffers; each backward (outside :meth:`no_sync`)
    reduce-scatters them so this rank's chunk holds the mean gradient of its shard (the master's ``.grad`` is a view
    of that chunk when reducing in fp32), and zeroes the chunks other ranks own. ``no_sync`` costs no extra memory.
    ``zero_grad`` zeroes the buffers lazily (the next backward writes each gradient instead of adding it to zeros).
    """

    stage = 1

    def __init__(self, module: nn.Module, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        super().__init__(module, optimizer_class, **kwargs)
        self._free_scratch: list[torch.Tensor] = []  # reduce-scatter outputs, each the size of the largest shard
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a scratch lent to a reduction in flight -> it

    def _make_bucketer(self) -> GradBucketer:
        return self._reduce_scatter_bucketer(keep_buffers=True, shard_out=self._scratch_out)

    def _scratch_out(self, bucket: FlatBucket) -> torch.Tensor:
        """Where a bucket is reduce-scattered to: a scratch tensor kept for it, since :meth:`_on_reduced` copies the
        shard into the kept buffer at once (at most ``max_inflight`` exist; a new tensor every bucket would be fresh
        memory to the CPU allocator, page-faulted in every step)."""
        if self.home(bucket.index).host:  # its landing reads the shard after this returns: a tensor of its own
            return torch.empty(bucket.shard_numel, dtype=self.policy.reduce_dtype, device=self.device)
        largest = max(b.shard_numel for b in self.buckets)
        scratch = (
            self._free_scratch.pop()
            if self._free_scratch
            else torch.empty(largest, dtype=self.policy.reduce_dtype, device=self.device)
        )
        self._lent[scratch.data_ptr()] = scratch
        return scratch[: bucket.shard_numel]

    def _on_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        self._reduced_into_kept_buffer(bucket, shard)
        scratch = self._lent.pop(shard.data_ptr(), None)
        if scratch is not None:
            self._free_scratch.append(scratch)

    def _scratch_storage(self) -> list[torch.Tensor]:
        return [*self._free_scratch, *self._lent.values()]
