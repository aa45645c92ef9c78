"""What a ZeRO optimizer tells the watchers of its gradient shards (:meth:`ZeroOptimizer.watch_grads
<elasticzero.engine.zero.base.ZeroOptimizer.watch_grads>`): a :class:`GradWatcher` is told of every reduction, in-place
multiply (a :class:`Factor`, as data) and ``zero_grad``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Factor:
    """One in-place multiply of every gradient shard (``unscale_``, ``clip_grad_norm_``), as data: ``value`` a 0-dim
    tensor; ``as_tensor`` False: the shards were multiplied by ``value.item()`` (a Python float, the loss scaler's
    ``inv_scale``), True: by ``value`` itself cast to each shard's dtype (the clip coefficient, fp32). Replaying them
    in order on a copy of the shards gives the same bits."""

    value: torch.Tensor
    as_tensor: bool


class GradWatcher(Protocol):
    """Told what happens to a ZeRO optimizer's gradient shards (:meth:`ZeroOptimizer.watch_grads`)."""

    def grads_changing(self, bucket: int | None) -> None:
        """The shard of ``bucket`` (None: every shard) is about to be written in place."""

    def grad_reduced(self, bucket: int, shard: torch.Tensor) -> None:
        """A reduction wrote ``bucket``'s gradient shard (the master's ``.grad``: ``shard``), on the current stream."""

    def grads_scaled(self, factor: Factor) -> None:
        """Every gradient shard was multiplied in place by ``factor``."""

    def grads_dropped(self) -> None:
        """``zero_grad``: the shards are gone (or zeroed)."""
