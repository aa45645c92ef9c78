"""What stages 1 and 2 share: the module's trainable parameters become views into flat compute buffers (one per
bucket, ``param_dtype``); the fp32 master shard is this rank's chunk of that buffer (fp32) or a separate fp32 copy of
it (bf16/fp16); after ``step()`` each bucket is all-gathered in place, so ``module.state_dict()`` holds the full
updated parameters. ``module.load_state_dict()`` works too: a post-hook copies what it loaded into the fp32 masters
(at the compute dtype's precision; :meth:`load_full_state_dict` keeps fp32)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.comm.work import same_memory
from elasticzero.engine.zero.flat import (
    FlatBucket,
    flatten_into,
    lying_flat,
    mark_flat,
    new_flat,
    storage_users,
    view_params_into,
)
from elasticzero.engine.zero.host import Offloader
from elasticzero.errors import UsageError


class _ReplicatedParamsZero(ZeroOptimizer):
    """Base of ZeroStage1/ZeroStage2: full parameters on every rank, sharded optimizer state."""

    def _materialize(self, bucket: FlatBucket) -> tuple[nn.Parameter, torch.Tensor]:
        """The master and the compute buffer (``param_dtype``, full size) the module's parameters view. At fp32 the
        buffer the parameters already lie flat in, where they do (:func:`~.flat.lying_flat`: a module an optimizer
        released without a copy, ``unwrap(copy=False)``): no copy, no new memory."""
        lo, hi = bucket.shard_range()
        compute_dtype = self._compute_dtype_of(bucket)
        kept = lying_flat(bucket, storage_users(self.module)) if compute_dtype == torch.float32 else None
        if kept is not None:
            with torch.no_grad():
                kept[bucket.numel :].zero_()  # its padding at this world
            return nn.Parameter(kept[lo:hi]), kept
        fp32 = new_flat(bucket, torch.float32, self.device)
        flatten_into(bucket, fp32)
        if compute_dtype == torch.float32:
            compute, master = fp32, nn.Parameter(fp32[lo:hi])
        else:
            master = nn.Parameter(fp32[lo:hi].clone())
            compute = fp32.to(compute_dtype)
        view_params_into(bucket, compute)
        if compute is fp32:
            mark_flat(bucket, compute)  # a later wrap may take it over (lying_flat)
        return master, compute

    def _reduced_into_kept_buffer(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        """``on_reduced`` over persistent bucket buffers (stage 1; stage 2 in a one-rank group): this rank's chunk of
        the buffer becomes the mean gradient of its shard (the previous mean plus this backward's), the chunks other
        ranks own are zeroed (a later backward without ``zero_grad`` accumulates onto zeros there), and the master's
        ``.grad`` views its chunk (fp32) or accumulates the shard in fp32 (a low-precision reduction)."""
        buf = self.bucketer.buffer(bucket)
        lo, hi = bucket.shard_range()
        master = self.masters[bucket.index]
        if self._land(bucket, shard):
            self.bucketer.forget(bucket)  # the next backward writes it afresh, after this landing settled
            return
        if buf.dtype != torch.float32:
            if master.grad is None:
                master.grad = shard.float()
            else:
                master.grad.add_(shard)
            buf.zero_()  # after reading the shard: a one-rank group's shard is the buffer itself
            return
        buf[:lo].zero_()
        buf[hi:].zero_()
        if not same_memory(buf[lo:hi], shard):  # a one-rank group reduces the buffer in place
            buf[lo:hi].copy_(shard)  # chunk = previous accumulated mean + this backward's mean
        master.grad = buf[lo:hi]

    def _land(self, bucket: FlatBucket, shard: torch.Tensor) -> bool:
        """An offloaded bucket: its reduced shard lands in host memory as the master's gradient (added to what it
        holds: accumulation); False for a bucket on the device."""
        if not self.home(bucket.index).host:
            return False
        self._offload.reduced(bucket.index, shard)  # type: ignore[union-attr]
        return True

    def _bind_offload(self, offloader: Offloader) -> None:
        """An offloaded bucket's updated shard is pushed into this rank's chunk of its compute buffer (then
        all-gathered from there)."""
        for b, compute in zip(self.buckets, self._flat, strict=True):
            if self.home(b.index).host:
                lo, hi = b.shard_range()
                offloader.push_into(b.index, compute[lo:hi])

    def _register_state_dict_hooks(self) -> list[RemovableHandle]:
        return [self.module.register_load_state_dict_post_hook(self._refresh_masters)]

    @torch.no_grad()
    def _refresh_masters(self, module: nn.Module, incompatible_keys: Any) -> None:
        """After ``module.load_state_dict``: copy the loaded parameters into the separate fp32 masters (bf16/fp16),
        which ``step()`` would otherwise all-gather back over them. Precision is that of the compute copies;
        :meth:`load_full_state_dict` keeps fp32."""
        for b, m, compute in zip(self.buckets, self.masters, self._flat, strict=True):
            storage = compute.untyped_storage().data_ptr()
            if any(p.untyped_storage().data_ptr() != storage for p in b.params):
                raise UsageError(
                    "module.load_state_dict(assign=True) replaced parameters the ZeRO optimizer manages: load "
                    "without assign=True, or use opt.load_full_state_dict(state_dict)"
                )
            lo, hi = b.shard_range()
            chunk = compute[lo:hi]
            if chunk.data_ptr() != m.data_ptr() or chunk.dtype != m.dtype:
                m.copy_(chunk)

    def _gather_params(self) -> None:
        works = []
        with torch.no_grad():
            for b, m, compute in zip(self.buckets, self.masters, self._flat, strict=True):
                lo, hi = b.shard_range()
                chunk = compute[lo:hi]
                if self.home(b.index).host:
                    self._offload.order(b.index)  # type: ignore[union-attr]  # pushed after its step
                elif chunk.data_ptr() != m.data_ptr() or chunk.dtype != m.dtype:
                    chunk.copy_(m)
                works.append(self.communicator.all_gather(compute, chunk, async_op=True))
            for w in works:
                w.wait()  # type: ignore[union-attr]
        self.communicator.settle()
