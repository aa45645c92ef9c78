"""ZeRO stages 1/2/3 as optimizers that wrap any ``torch.optim.Optimizer`` class; the user keeps a plain loop::

    opt = ZeroStage2(model, torch.optim.AdamW, lr=3e-4, precision="bf16")
    for x, y in loader:
        loss_fn(model(x), y).backward()       # repeated backward accumulates; ``with opt.no_sync():`` defers comm
        opt.clip_grad_norm_(1.0)              # global norm over all shards (one scalar all-reduce)
        opt.step(); opt.zero_grad()

``ZeroStage1`` shards optimizer state, ``ZeroStage2`` also gradients, ``ZeroStage3`` also parameters. Each is a
``torch.optim.Optimizer`` (LR schedulers work; ``param_groups``/``state`` are the wrapped optimizer's, built on this
rank's fp32 master shards). Common constructor arguments are documented on
:class:`~elasticzero.engine.zero.base.ZeroOptimizer`, stage-3 extras on
:class:`~elasticzero.engine.zero.stage3.ZeroStage3`.

Layout (:mod:`~elasticzero.engine.zero.layout`): trainable parameters in registration order go into flat buckets,
each padded to a multiple of the world size and split into equal contiguous shards (balanced to one element);
``opt.layout`` is the :class:`ZeroLayout` (what every rank owns of every parameter), ``opt.partition`` maps every
parameter name to its ``ParamSlot`` (bucket, offset, global offset, numel, shape). ``opt.sharded_state()`` is this
rank's share of the state per parameter (:class:`ShardedState`), what :class:`ZeroCheckpointState` saves and loads.

Bytes held per trainable parameter (fp32 AdamW, N ranks, what :meth:`memory_report` sums from the real tensors):

=========  ==================================================  ============
stage      buffers                                              N=2
=========  ==================================================  ============
1          params 4 (master shard is a view) + full grad 4      12
           + Adam 8/N
2          params 4 + grad shard 4/N + Adam 8/N                  10
3          master shard 4/N + grad shard 4/N + Adam 8/N          8
=========  ==================================================  ============

(bf16/fp16: params are 2-byte compute copies and the fp32 master shard, 4/N, is separate.) Gradient shards exist from
the first backward until ``zero_grad(set_to_none=True)``; measure between ``step()`` and ``zero_grad`` for the peak.

Traffic per step (each optimizer's :class:`~elasticzero.engine.zero.comm.Communicator` counts its collectives, in
``opt.comm_stats``): stages 1/2 reduce-scatter Ψ + all-gather Ψ = 2Ψ; stage 3 all-gather Ψ
in forward and again in backward + reduce-scatter Ψ = 3Ψ (Ψ counted with each bucket's < N padding elements).
Names resolve lazily (PEP 562) so that ``elasticzero.engine.zero.comm`` imports without the stages.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "ZeroStage1": "elasticzero.engine.zero.stage1",
    "ZeroStage2": "elasticzero.engine.zero.stage2",
    "ZeroStage3": "elasticzero.engine.zero.stage3",
    "CommStats": "elasticzero.engine.zero.comm.stats",
    "Communicator": "elasticzero.engine.zero.comm.communicator",
    "FlatBucket": "elasticzero.engine.zero.flat",
    "ParamSlot": "elasticzero.engine.zero.layout",
    "BucketLayout": "elasticzero.engine.zero.layout",
    "ZeroLayout": "elasticzero.engine.zero.layout",
    "Piece": "elasticzero.engine.zero.layout",
    "FlatChunk": "elasticzero.engine.zero.layout",
    "ShardedState": "elasticzero.engine.zero.sharded",
    "ZeroCheckpointState": "elasticzero.engine.zero.dcp_state",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
