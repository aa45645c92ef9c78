"""What a ZeRO optimizer shows of its state without stepping it: the full and sharded state dicts, the module's own
state, tied aliases, and the memory it holds (:class:`ZeroStateViews`, a base of
:class:`~elasticzero.engine.zero.base.ZeroOptimizer`; it reads the attributes the optimizer sets up)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from elasticzero.engine.bucketer import GradBucketer
from elasticzero.engine.precision import PrecisionPolicy
from elasticzero.engine.zero.comm.communicator import OwnsCommunicator
from elasticzero.engine.zero.flat import FlatBucket
from elasticzero.engine.zero.host import Offloader
from elasticzero.engine.zero.layout import ParamSlot, ZeroLayout
from elasticzero.engine.zero.memory import model_state_report
from elasticzero.engine.zero.sharded import Origin, ShardedState
from elasticzero.engine.zero.standin import is_stand_in
from elasticzero.errors import UsageError


class ZeroStateViews(OwnsCommunicator):
    """The state views and memory report of a ZeRO optimizer (see :class:`~elasticzero.engine.zero.base.ZeroOptimizer`
    for the attributes below)."""

    stage: int
    module: nn.Module
    policy: PrecisionPolicy
    rank: int
    world_size: int
    numel: int
    layout: ZeroLayout
    partition: dict[str, ParamSlot]
    buckets: list[FlatBucket]
    masters: list[nn.Parameter]
    optim: torch.optim.Optimizer
    bucketer: GradBucketer
    device: torch.device
    _flat: list[torch.Tensor]
    _own_module_state_dict: bool
    _offload: Offloader | None  # ZeRO-Offload's moving parts (None: every bucket on the device)

    # -- stage hooks ---------------------------------------------------------------------------------------------
    def _gather_params(self) -> None:
        """Bring the updated masters back into the module's parameters (stages 1/2: all-gather)."""

    def _offload_buffers(self) -> list[torch.Tensor | None]:
        """ZeRO-Offload's own host buffers: gradient shards, staging, compute-dtype shards (memory accounting)."""
        return [] if self._offload is None else list(self._offload.host_buffers())

    def _held_grad_storage(self) -> list[torch.Tensor]:
        """Gradient storage a stage keeps between steps beyond the masters' ``.grad`` and the bucketer's buffers
        (stage 2: its persistent fp32 gradient shards), for :meth:`memory_report`."""
        return []

    def _scratch_storage(self) -> list[torch.Tensor]:
        """Communication buffers kept between steps for reuse, not model state (:meth:`memory_report`'s ``scratch``):
        the bucketer's spares (stage 2); stage 1 adds its reduce-scatter outputs."""
        return self.bucketer.spare_buffers()

    @contextlib.contextmanager
    def _reading_module_state(self) -> Any:
        """Mark ``module.state_dict()`` calls made by this optimizer itself (the stage-3 hooks let them through)."""
        old, self._own_module_state_dict = self._own_module_state_dict, True
        try:
            yield
        finally:
            self._own_module_state_dict = old

    # -- full state (any world size) ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (fp32 trainable parameters from the masters) on every rank.

        Collective: every rank must call it. Keys are those of ``module.state_dict()`` (tied parameters under each
        name); frozen parameters are copied from the module, buffers from group rank 0's module (broadcast: buffers
        such as BatchNorm running statistics are updated by each rank's own batches, as under DDP with
        ``broadcast_buffers=False``; the state dict is the same on every rank).
        """
        full: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for b, m in zip(self.buckets, self.masters, strict=True):
                out = torch.empty(b.padded_numel, dtype=torch.float32, device=self.device)
                self.communicator.all_gather(out, m.detach().to(self.device), tag="state_dict")  # offloaded: H2D
                for p, off in zip(b.params, b.offsets, strict=True):
                    full[id(p)] = out[off : off + p.numel()].view(p.shape).clone()
        sd = {}
        with self._reading_module_state():
            module_sd = self.module.state_dict(keep_vars=True)
        buffers = {id(t) for t in self.module.buffers()}
        for k, v in module_sd.items():
            sd[k] = full[id(v)] if id(v) in full else v.detach().clone()
            if id(v) in buffers:
                self.communicator.broadcast(sd[k], 0, tag="state_dict")
        return sd

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a full model state dict (what :meth:`full_state_dict` returns, any world size) into this rank's master
        shards and the module (frozen parameters and buffers are copied as they are).

        Collective on stages 1/2 (the updated parameters are all-gathered into the module). Pair it with
        :meth:`load_state_dict` for the optimizer state to resume training.
        """
        missing = [n for n in self.partition if n not in state_dict]
        if missing:
            raise UsageError(f"state dict lacks trainable parameters: {', '.join(missing[:5])}")
        for b, m in zip(self.buckets, self.masters, strict=True):
            for name, start, end, off in b.local_pieces():
                m[off : off + end - start].copy_(state_dict[name].reshape(-1)[start:end])
        for k, v in self.module_state().items():
            if k in state_dict:
                v.copy_(state_dict[k])
        self.refresh_params()

    # -- sharded state (checkpoints, resharding) --------------------------------------------------------------------
    @property
    def origin(self) -> Origin:
        """Stage, world size, precision and wrapped optimizer of this run, as a checkpoint records them."""
        precision = str(self.policy.param_dtype).removeprefix("torch.")
        return Origin(self.stage, self.world_size, precision, type(self.optim).__name__)

    def sharded_state(
        self, masters: Sequence[torch.Tensor] | None = None, states: Sequence[Mapping[str, Any]] | None = None
    ) -> ShardedState:
        """This rank's share of the model and optimizer state, per parameter, over :attr:`layout` (not collective).

        Default: views of the live masters and of the wrapped optimizer's state (a master that has not stepped has
        none). ``masters`` / ``states`` (one per bucket, laid out like the masters) describe other tensors instead:
        a load buffer, a fresh optimizer's state. Frozen parameters and buffers are the live module's."""
        masters = [m.detach() for m in self.masters] if masters is None else masters
        states = [self.optim.state.get(m, {}) for m in self.masters] if states is None else states
        return ShardedState.of(
            self.layout,
            self.rank,
            masters,
            states,
            origin=self.origin,
            aliases=self.tied_aliases(),
            param_groups=self.optim.param_groups,
            module=self.module_state(),
        )

    def module_state(self) -> dict[str, torch.Tensor]:
        """The module's state the masters do not hold: frozen parameters and buffers (live tensors, detached), by
        ``module.state_dict()`` key; tied aliases of trainable parameters are left out."""
        managed = {id(p) for p in self._managed_params()}
        with self._reading_module_state():
            module_sd = self.module.state_dict(keep_vars=True)
        return {k: v.detach() for k, v in module_sd.items() if id(v) not in managed}

    def tied_aliases(self) -> dict[str, str]:
        """``{alias: name}``: ``module.state_dict()`` keys tied to a trainable parameter :attr:`partition` holds
        under another ``name``."""
        first = {id(p): n for b in self.buckets for n, p in zip(b.names, b.params, strict=True)}
        with self._reading_module_state():
            module_sd = self.module.state_dict(keep_vars=True)
        return {k: first[id(v)] for k, v in module_sd.items() if id(v) in first and first[id(v)] != k}

    def master_views_params(self, index: int) -> bool:
        """Whether bucket ``index``'s master shard lives in the buffer the module's parameters view (fp32 stages 1/2):
        its storage must then stay that buffer (a load copies into it; swapping it would cut the parameters off)."""
        return self.masters[index].untyped_storage().data_ptr() == self._flat[index].untyped_storage().data_ptr()

    def refresh_params(self) -> None:
        """Bring the module's parameters up to date with the masters after they were written to (a load): stages
        1/2 all-gather them (collective), stage 3 drops what is gathered (the next forward gathers afresh); the
        offloaded buckets' copies on the device are pushed first."""
        if self._offload is not None:
            self._offload.push_all()
        self._gather_params()

    def memory_report(self) -> dict[str, float]:
        """Bytes of model state this rank holds right now, from the real tensors, each storage counted once.

        Categories: ``params`` (storages behind the module's trainable parameters; for fp32 stages 1/2 the master
        shard is a view into them and is not counted again), ``master`` (fp32 master shards), ``grads`` (gradient
        shards, persistent/outstanding bucket buffers, stray ``param.grad``), ``optim_state`` (tensors in the
        wrapped optimizer's state), ``frozen`` (frozen parameters, not part of the total), ``scratch`` (communication
        buffers kept for the next backward: stage 2's reduced bucket buffers, at most ``max_inflight + 1``; stage 1's
        reduce-scatter outputs, at most ``max_inflight`` shards; not model state, not part of the total); plus
        ``total`` (the first four), ``numel`` (Ψ, trainable elements) and ``bytes_per_param`` (``total / numel``).

        Gradients count only while held: call it after ``step()`` and before ``zero_grad(set_to_none=True)`` to see
        the paper's numbers (fp32 AdamW, N=2: 12 / 10 / 8 for stages 1 / 2 / 3); ZeRO-3 units count only while
        gathered. Not collective.
        """
        trainable = self._managed_params()
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        state = [t for s in self.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return model_state_report(
            [
                ("params", trainable),
                ("master", self.masters),
                (
                    "grads",
                    [m.grad for m in self.masters]
                    + self._held_grad_storage()
                    + self.bucketer.held_buffers()
                    + [p.grad for p in trainable if not is_stand_in(p.grad)]
                    + self._offload_buffers(),
                ),
                ("optim_state", state),
                ("frozen", frozen),
                ("scratch", self._scratch_storage()),
            ],
            self.numel,
        )

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _managed_params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]
