"""ZeRO stage 2: optimizer state and gradients sharded.

Held per rank (Ψ trainable elements, N ranks, fp32 Adam): parameters 4Ψ (views into flat fp32 buffers; the master
shard is a view into them), fp32 gradient shard 4Ψ/N, Adam state 8Ψ/N — 10 bytes/param at N=2 — plus transient bucket
buffers during backward (at most ``max_inflight + 1`` buckets of ``bucket_bytes``). bf16/fp16: 2Ψ compute params +
4Ψ/N master + 4Ψ/N grads + 8Ψ/N. Communication per step: reduce-scatter Ψ (overlapped with backward, bucket by
bucket as they fill) + all-gather Ψ (after ``step()``) = 2Ψ.
"""

from __future__ import annotations

import torch

from elasticzero.engine.bucketer import GradBucketer
from elasticzero.engine.zero.flat import FlatBucket
from elasticzero.engine.zero.stage12 import _ReplicatedParamsZero


class ZeroStage2(_ReplicatedParamsZero):
    """ZeRO-2 optimizer wrapper (see :class:`~elasticzero.engine.zero.base.ZeroOptimizer` for the arguments).

    During backward each bucket is reduce-scattered as soon as it is complete (in the fixed flush order) and its full
    gradient buffer freed; this rank accumulates only its fp32 shard (the master's ``.grad``).
    """

    stage = 2

    def _make_bucketer(self) -> GradBucketer:
        return self._reduce_scatter_bucketer(keep_buffers=False)

    def _on_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        master = self.masters[bucket.index]
        if master.grad is None:
            master.grad = shard if shard.dtype == torch.float32 else shard.float()
        else:
            master.grad.add_(shard)
