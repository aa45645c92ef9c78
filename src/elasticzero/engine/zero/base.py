"""What ZeroStage1/2/3 share: parameter discovery, buckets, masters, the wrapped optimizer, clipping, unscaling,
state dicts and memory accounting. The stages differ in where gradients and parameters live (see each stage)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from elasticzero.engine.bucketer import DEFAULT_BUCKET_BYTES, GradBucketer, phase
from elasticzero.engine.precision import PrecisionPolicy, as_policy
from elasticzero.engine.zero import clip, comm
from elasticzero.engine.zero.flat import FlatBucket, Grouping, _device_of, layout_buckets, size_groups
from elasticzero.engine.zero.host import Offloader, state_bytes_per_element
from elasticzero.engine.zero.layout import ParamSlot, ZeroLayout
from elasticzero.engine.zero.memory import storage_report
from elasticzero.engine.zero.offload import (
    BucketHome,
    OffloadOptions,
    check_stage,
    early_step_blocker,
    plan_homes,
)
from elasticzero.engine.zero.sharded import Origin, ShardedState
from elasticzero.errors import UsageError


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


class ZeroOptimizer(torch.optim.Optimizer):
    """Base of the ZeRO stages: a ``torch.optim.Optimizer`` whose real work is done by ``optimizer_class`` built on
    this rank's fp32 master shards.

    Args:
        module: the model; its trainable parameters are re-laid out into flat buckets (identity of every
            ``nn.Parameter`` is kept, only ``.data`` changes). Frozen parameters are left alone (cast to the compute
            dtype under a low-precision policy).
        optimizer_class: any ``torch.optim.Optimizer`` class, e.g. ``torch.optim.AdamW``.
        process_group: data-parallel group (default: the default group); exposed as ``opt.process_group``.
        precision: ``"fp32" | "bf16" | "fp16"`` or a :class:`~elasticzero.engine.precision.PrecisionPolicy`.
        param_groups: optional list of dicts ``{"params": [model parameters], **options}`` (like torch's); every
            trainable parameter must appear in exactly one. Default: one group with all of them.
        bucket_bytes: bucket bound in bytes of ``reduce_dtype`` (ZeRO-3 ignores it: one bucket per unit).
        max_inflight: outstanding gradient collectives during backward (bounds transient buffers).
        timers: optional ``PhaseTimers`` (phases ``"reduce"``, ``"step"``, ``"allgather"``); None costs nothing.
        sync_module_states: broadcast parameters and buffers from group rank 0 at construction.
        cast_forward_inputs: under a low-precision policy, cast floating-point forward inputs of ``module`` to the
            compute dtype.
        grouping: how the trainable parameters form buckets (a stage's bucketing; stage 3 passes its units).
            Default: by ``bucket_bytes``, per param group, dtype and compute dtype, in registration order.
        offload: ZeRO-Offload (:class:`~elasticzero.engine.zero.offload.OffloadOptions`): the fp32 masters, the
            optimizer state and the step in host memory, for the buckets its budget picks (docs/engine.md,
            "ZeRO-Offload"). On a CPU device it changes nothing. None: everything on the device.
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr=...``, ``weight_decay=...``). Where they choose
            neither ``fused`` nor ``foreach`` and ``optimizer_class`` takes ``fused`` (torch's Adam, AdamW, SGD,
            Adagrad), the engine asks for ``fused=True``: one kernel per flat master shard per step (see
            :func:`optimizer_kwargs_for`); ``fused=False`` gets torch's default implementation back.

    Attributes:
        layout: the :class:`~elasticzero.engine.zero.layout.ZeroLayout` (every bucket, its param group and slots;
            ``layout.pieces(rank)`` is what any rank owns of each parameter), equal on every rank.
        partition: ``layout.params``: ``{name: ParamSlot}`` — bucket, offset inside the bucket and in the global flat
            index space, numel and shape of every trainable parameter (tied parameters appear once, under their first
            name).
        buckets: the :class:`~elasticzero.engine.zero.flat.FlatBucket` s (a bucket's layout bound to its live
            parameters and this rank); ``bucket.local_pieces()`` maps this rank's shard back to parameter slices.
        communicator: the :class:`~elasticzero.engine.zero.comm.Communicator` issuing this optimizer's (and its
            bucketer's) collectives; assigning one on another group of the same ranks replaces it (the old one is
            closed).
        comm_stats: :class:`~elasticzero.engine.zero.comm.CommStats` of this optimizer's collectives (its
            communicator's).
        device: the device of the trainable parameters (all on one, else ``UsageError``); every flat buffer, master
            shard and scalar (norm, found_inf) is allocated there.
        optim: the wrapped optimizer (its ``param_groups`` and ``state`` *are* this object's).
    """

    stage: int = 0
    supports_no_sync: bool = True
    """Whether :meth:`no_sync` defers communication (False on stage 3, where it raises);
    :class:`~elasticzero.engine.accumulation.GradAccumulation` falls back to a plain context then."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        process_group: Any = None,
        precision: str | PrecisionPolicy = "fp32",
        param_groups: Sequence[dict[str, Any]] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        max_inflight: int = 2,
        timers: Any = None,
        sync_module_states: bool = True,
        cast_forward_inputs: bool = True,
        grouping: Grouping | None = None,
        offload: OffloadOptions | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not dist.is_initialized():
            raise UsageError(f"{type(self).__name__} needs torch.distributed initialised (init_process_group)")
        self.module = module
        self._communicator = comm.Communicator(process_group, owner=type(self).__name__)
        self.world_size = self._communicator.size
        self.rank = self._communicator.rank
        self.policy = as_policy(precision)
        self.timers = timers
        self.bucket_bytes = bucket_bytes
        self.max_inflight = max_inflight

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError(f"{type(self).__name__}: the module has no trainable parameters")
        # before any collective: every flat buffer, master and scalar is allocated on this device
        self.device: torch.device = _device_of(p for _, p in named)
        self._group_of, group_options = _assign_groups(named, param_groups)
        self._compute_dtype = _compute_dtypes(module, self.policy)  # id(param) -> dtype of its compute copy
        if sync_module_states:
            self._broadcast_module()
        grouping = grouping or _by_size(bucket_bytes, self.policy.reduce_dtype)
        self.buckets: list[FlatBucket] = layout_buckets(
            grouping(named, self._bucket_key),
            world_size=self.world_size,
            rank=self.rank,
            key=self._bucket_key,
            group=self._group_of.__getitem__,
        )
        self.layout = ZeroLayout(self.world_size, tuple(b.layout for b in self.buckets))
        self.partition: dict[str, ParamSlot] = self.layout.params
        self.numel = self.layout.numel
        check_stage(offload, self.stage)
        self.offload = offload  # what was asked; where each bucket went: home(i)
        self._offload = _offloader(offload, self.device, self.buckets, optimizer_class, optimizer_kwargs)
        made = [self._materialize(b) for b in self.buckets]
        self.masters: list[nn.Parameter] = [self._adopt(i, master) for i, (master, _) in enumerate(made)]
        self._flat: list[torch.Tensor] = [flat for _, flat in made]  # per bucket: the buffer its parameters view
        self._cast_frozen()

        inner_groups = []
        for gi, opts in enumerate(group_options):
            # a group whose parameters are all frozen stays, empty, so group indices match the user's (schedulers)
            masters = [self.masters[i] for i in self.layout.group_buckets(gi)]
            inner_groups.append({**opts, "params": masters})
        self.optim = _build_optimizer(optimizer_class, inner_groups, optimizer_kwargs)
        torch.optim.Optimizer.__init__(self, list(self.masters), dict(self.optim.defaults))
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self.defaults = self.optim.defaults
        self._ready = True
        if self._offload is not None:
            self._offload.bind(self.optim, self.masters, [self._compute_dtype_of(b) for b in self.buckets])
            self._bind_offload(self._offload)
            self._offload.push_all()
        self._grad_watchers: OrderedDict[int, GradWatcher] = OrderedDict()  # a RemovableHandle refers to it weakly
        self.bucketer = self._make_bucketer()
        self._input_hook = None
        if cast_forward_inputs and self.policy.param_dtype != torch.float32:
            self._input_hook = module.register_forward_pre_hook(
                _input_caster(self.policy.param_dtype), with_kwargs=True
            )
        self._fp32_hooks = _keep_fp32_hooks(module, self.policy)
        self._own_module_state_dict = False  # set while full_state_dict/load_full_state_dict read the module
        self._register_state_dict_hooks()

    # -- stage hooks (overridden; those called while constructing read only what the base set before) -----------
    @property
    def process_group(self) -> Any:
        """The data-parallel group (held weakly: a :class:`UsageError` once it was destroyed)."""
        return self._communicator.group

    @property
    def communicator(self) -> comm.Communicator:
        """Issues, counts and settles this optimizer's collectives and its bucketer's."""
        return self._communicator

    @communicator.setter
    def communicator(self, new: comm.Communicator) -> None:
        """Replace it by ``new`` (a group of the same ranks, e.g. rebuilt in this process); the old one is closed
        first (:meth:`~elasticzero.engine.zero.comm.Communicator.close`: if its group failed, close it yourself and
        handle the error, then assign)."""
        comm.check_replacement(self._communicator, new, type(self).__name__)
        self._communicator.close()
        self._communicator = new
        self.bucketer.communicator = new

    @property
    def comm_stats(self) -> comm.CommStats:
        """Counters of this optimizer's collectives (its communicator's)."""
        return self._communicator.stats

    def _bucket_key(self, p: nn.Parameter) -> tuple[int, torch.dtype, torch.dtype]:
        """Parameters share a bucket when they share (param group, dtype, compute dtype)."""
        return self._group_of[p], p.dtype, self._compute_dtype[id(p)]

    def _compute_dtype_of(self, bucket: FlatBucket) -> torch.dtype:
        """The dtype of the bucket's parameters in the forward (one per bucket: part of the bucket key)."""
        return self._compute_dtype[id(bucket.params[0])]

    def _materialize(self, bucket: FlatBucket) -> tuple[nn.Parameter, torch.Tensor]:
        """This rank's fp32 master shard of ``bucket``, and the full flat buffer the bucket's parameters now view."""
        raise NotImplementedError

    def _adopt(self, index: int, master: nn.Parameter) -> nn.Parameter:
        """The master of bucket ``index`` where its offload home says: itself, or a host copy."""
        return master if self._offload is None else self._offload.adopt(index, master)

    def _bind_offload(self, offloader: Offloader) -> None:
        """Tell ``offloader`` where each offloaded bucket's updated shard goes on the device (a stage's choice)."""

    def home(self, index: int) -> BucketHome:
        """Where bucket ``index``'s optimizer state lives (:class:`~elasticzero.engine.zero.offload.BucketHome`)."""
        return BucketHome() if self._offload is None else self._offload.home(index)

    def _make_bucketer(self) -> GradBucketer:
        raise NotImplementedError

    def _reduce_scatter_bucketer(self, **overrides: Any) -> GradBucketer:
        """The gradient bucketer every stage uses: reduce-scatter over this optimizer's buckets into
        ``_on_reduced``; ``overrides`` carry each stage's own choices (buffer keeping, launch timing)."""
        return GradBucketer(
            op="reduce_scatter",
            communicator=self.communicator,
            reduce_dtype=self.policy.reduce_dtype,
            buckets=self.buckets,
            on_reduced=self._reduced,
            max_inflight=self.max_inflight,
            timers=self.timers,
            on_finalize=self._end_backward,
            **overrides,
        )

    def _end_backward(self) -> None:
        """The bucketer's ``on_finalize``: every gradient shard of this backward is where it lives (offload: landed
        in host memory)."""
        if self._offload is not None:
            self._offload.end_backward()

    def _reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        """The bucketer's ``on_reduced``: the stage's :meth:`_on_reduced`, between telling the watchers."""
        watchers = list(self._grad_watchers.values())
        for w in watchers:
            w.grads_changing(bucket.index)
        self._on_reduced(bucket, shard)
        if watchers and self.home(bucket.index).host:
            self._offload.settle(bucket.index)  # type: ignore[union-attr]  # the watchers read the host gradient
        grad = self.masters[bucket.index].grad
        if grad is not None:  # every stage sets it here
            for w in watchers:
                w.grad_reduced(bucket.index, grad)

    def _on_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        raise NotImplementedError

    def _gather_params(self) -> None:
        """Bring the updated masters back into the module's parameters (stages 1/2: all-gather)."""

    def _held_grad_storage(self) -> list[torch.Tensor]:
        """Gradient storage a stage keeps between steps beyond the masters' ``.grad`` and the bucketer's buffers
        (stage 2: its persistent fp32 gradient shards), for :meth:`memory_report`."""
        return []

    def _scratch_storage(self) -> list[torch.Tensor]:
        """Communication buffers kept between steps for reuse, not model state (:meth:`memory_report`'s ``scratch``):
        the bucketer's spares (stage 2); stage 1 adds its reduce-scatter outputs."""
        return self.bucketer.spare_buffers()

    def _register_state_dict_hooks(self) -> None:
        """Hooks on ``module.state_dict`` / ``module.load_state_dict`` (stages 1/2: keep masters in sync; 3: refuse)."""

    @contextlib.contextmanager
    def _reading_module_state(self) -> Any:
        """Mark ``module.state_dict()`` calls made by this optimizer itself (the stage-3 hooks let them through)."""
        old, self._own_module_state_dict = self._own_module_state_dict, True
        try:
            yield
        finally:
            self._own_module_state_dict = old

    # -- torch.optim.Optimizer API ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step on this rank's master shards, then (stages 1/2) all-gather the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with phase(self.timers, "step"):
            if self._offload is None:
                self.optim.step()
            else:
                self._offload.step()  # bucket by bucket, the offloaded ones on the host, each pushed as it steps
        with phase(self.timers, "allgather"):
            self._gather_params()
        return loss

    @contextlib.contextmanager
    def stepping_in_backward(self, *, clipping: bool = False, loss_scaling: bool = False) -> Iterator[str | None]:
        """Around the backward that ends an optimizer step: each offloaded bucket takes its step on the host as soon
        as its gradient lands, overlapped with the rest of backward; :meth:`step` then steps what is left and waits.
        Only where :func:`~elasticzero.engine.zero.offload.early_step_blocker` allows it (no clipping, no loss
        scaler, no gradient watcher); yields why not (None: armed). Without offloaded buckets it does nothing."""
        reason = early_step_blocker(
            armed=True, clipping=clipping, loss_scaling=loss_scaling, watched=bool(self._grad_watchers)
        )
        if self._offload is None or not self._offload.plan.any_host:
            yield "no bucket is offloaded"
            return
        self._offload.armed = reason is None
        try:
            yield reason
        finally:
            self._offload.armed = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero the gradient shards, and any gradient still held for accumulation."""
        for w in list(self._grad_watchers.values()):
            w.grads_dropped()
        for p in self._managed_params():
            p.grad = None
        self.bucketer.zero_buffers()
        for m in self.masters:
            if m.grad is not None:
                if set_to_none:
                    m.grad = None
                else:
                    m.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (the wrapped optimizer's ``state_dict`` over its shards) plus a ``"zero"``
        entry describing the partition (stage, world size, rank, ``name -> (global_offset, numel)``).

        Rank-local, as torch's ``Optimizer`` contract has it (code that saves ``opt.state_dict()`` keeps working):
        it loads back on the same rank of the same world size and layout only. State that moves to another world
        size or stage goes through :meth:`sharded_state` (checkpoints:
        :class:`~elasticzero.engine.zero.dcp_state.ZeroCheckpointState`)."""
        sd = self.optim.state_dict()
        sd["zero"] = {
            "stage": self.stage,
            "world_size": self.world_size,
            "rank": self.rank,
            "partition": self._partition_record(),
        }
        return sd

    def _partition_record(self) -> dict[str, tuple[int, int]]:
        return {n: (s.global_offset, s.numel) for n, s in self.partition.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on the same rank of the same world size and layout."""
        sd = dict(state_dict)
        meta = sd.pop("zero", None)
        if meta is not None and (meta["world_size"], meta["rank"]) != (self.world_size, self.rank):
            raise UsageError(
                f"optimizer state was saved by rank {meta['rank']} of {meta['world_size']}, this is rank "
                f"{self.rank} of {self.world_size}; optimizer state does not reshard to another world size yet: "
                "move the weights with opt.full_state_dict() / opt.load_full_state_dict()"
            )
        if meta is not None and meta["partition"] != self._partition_record():
            raise UsageError("optimizer state was saved with a different bucket layout (bucket_bytes or model differ)")
        self.optim.load_state_dict(sd)
        # torch's load_state_dict rebinds param_groups/state: keep ours the same objects (schedulers read ours)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after construction: pass ``param_groups=`` to the constructor."""
        if not getattr(self, "_ready", False):  # called by torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        raise UsageError("ZeRO optimizers take all parameter groups at construction (param_groups=...)")

    # -- ZeRO extras ----------------------------------------------------------------------------------------------
    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 gradient shards (one per bucket that has a gradient)."""
        return [m.grad for m in self.masters if m.grad is not None]

    def grad_pieces(self) -> list[torch.Tensor]:
        """This rank's gradient shards split at parameter boundaries (views; one per parameter slice it owns)."""
        pieces = []
        for b, m in zip(self.buckets, self.masters, strict=True):
            if m.grad is not None:
                pieces += [m.grad[off : off + end - start] for _, start, end, off in b.local_pieces()]
        return pieces

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (all shards of all ranks) to ``max_norm``; returns the total norm.

        One scalar all-reduce. Same formula and accuracy as ``torch.nn.utils.clip_grad_norm_`` (per-parameter norms,
        then the norm of the norms, over this rank's slice of each parameter).
        """
        total = clip.global_grad_norm(self.grad_pieces(), float(norm_type), self.communicator, self.device)
        self._scale_grads(Factor(clip.clip_coef(max_norm, total), as_tensor=True))
        return total

    @torch.no_grad()
    def unscale_(self, inv_scale: float) -> torch.Tensor:
        """Loss-scaler protocol: multiply this rank's gradient shards by ``inv_scale``; return a 0-dim fp32 tensor,
        1.0 if a local inf/NaN was found, else 0.0 (the scaler agrees on it over ``process_group``)."""
        with self._scaling(Factor(torch.tensor(inv_scale, dtype=torch.float64), as_tensor=False)):
            return clip.unscale_and_check_(self.grad_shards(), inv_scale, self.device)

    def _scale_grads(self, factor: Factor) -> None:
        """Multiply every gradient shard in place by the tensor ``factor``, telling the watchers."""
        with self._scaling(factor):
            clip.scale_by_(self.grad_shards(), factor.value)

    @contextlib.contextmanager
    def _scaling(self, factor: Factor) -> Iterator[None]:
        """Around an in-place multiply of every gradient shard by ``factor``: the watchers are told before (a send
        still reading a shard completes) and after (the factor, as data)."""
        watchers = list(self._grad_watchers.values())
        for w in watchers:
            w.grads_changing(None)
        yield
        for w in watchers:
            w.grads_scaled(factor)

    def watch_grads(self, watcher: GradWatcher) -> RemovableHandle:
        """Tell ``watcher`` what happens to the gradient shards (:class:`GradWatcher`: reductions, in-place
        multiplies, ``zero_grad``), until the returned handle's ``remove()``."""
        handle = RemovableHandle(self._grad_watchers)
        self._grad_watchers[handle.id] = watcher
        return handle

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without communicating until the first backward outside the context.

        Memory trade-off: the full gradient (Ψ elements of ``reduce_dtype``) is held until that backward, i.e. stage 2
        gives up its gradient sharding for the accumulation window (stage 1 holds a full gradient anyway, so it costs
        nothing there). Saves ``accumulation_steps - 1`` reduce-scatters per step. Not available on stage 3.
        """
        return self.bucketer.no_sync()

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
                self.communicator.all_gather(out, m.detach().to(self.device), tag="state_dict")
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
        offloaded buckets' device copies are pushed first."""
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
        rep: dict[str, float] = dict(
            storage_report(
                [
                    ("params", trainable),
                    ("master", self.masters),
                    (
                        "grads",
                        [m.grad for m in self.masters]
                        + self._held_grad_storage()
                        + self.bucketer.held_buffers()
                        + [p.grad for p in trainable]
                        + self._offload_buffers(),
                    ),
                    ("optim_state", state),
                    ("frozen", frozen),
                    ("scratch", self._scratch_storage()),
                ]
            )
        )
        rep["total"] = sum(rep[k] for k in ("params", "master", "grads", "optim_state"))
        rep["numel"] = self.numel
        rep["bytes_per_param"] = rep["total"] / self.numel
        return rep

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _offload_buffers(self) -> list[torch.Tensor | None]:
        """The offload's own host buffers (gradient shards, staging, compute-dtype shards)."""
        return [] if self._offload is None else list(self._offload.host_buffers())

    def _managed_params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    def _broadcast_module(self) -> None:
        seen: set[int] = set()
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    self.communicator.broadcast(t.data, 0)

    def _cast_frozen(self) -> None:
        dtype = self.policy.param_dtype
        for m in self.module.modules():
            if self.policy.keeps_fp32(m):
                continue
            for p in m.parameters(recurse=False):
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(dtype)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.optim).__name__}, world_size={self.world_size}, "
            f"buckets={len(self.buckets)}, numel={self.numel}, precision={self.policy})"
        )


def _offloader(
    options: OffloadOptions | None,
    device: torch.device,
    buckets: Sequence[FlatBucket],
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: Mapping[str, Any],
) -> Offloader | None:
    """The offload of these buckets on ``device`` (None when no bucket leaves it: no options, a CPU device)."""
    if options is None or not options.enabled:
        return None
    per_element = 4 + state_bytes_per_element(optimizer_class, dict(kwargs))  # fp32 master + optimizer state
    plan = plan_homes(options, str(device), [b.shard_numel * per_element for b in buckets])
    return Offloader(plan, device) if plan.any_host else None


def optimizer_kwargs_for(optimizer_class: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments the wrapped optimizer is built with: ``kwargs`` plus ``fused=True`` when the caller chose
    neither ``fused`` nor ``foreach`` and ``optimizer_class`` takes ``fused``.

    Why: the masters are a few large flat fp32 tensors (one per bucket), so a fused optimizer updates each in one
    element-wise pass with no temporaries, where torch's default on the CPU (a loop of single-tensor ops) makes about
    ten passes and allocates two master-sized temporaries per bucket and step (``sqrt``, ``div``). The update is the
    same element-wise math (within fp32 rounding of torch's other implementations; fused on a flat master equals
    fused on the separate parameters bitwise)."""
    chosen = "fused" in kwargs or "foreach" in kwargs
    takes_fused = "fused" in inspect.signature(optimizer_class).parameters
    return dict(kwargs) if chosen or not takes_fused else {**kwargs, "fused": True}


def _build_optimizer(
    optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]], kwargs: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """``optimizer_class(groups, **optimizer_kwargs_for(...))``; where torch refuses the fused default (no fused
    kernel for this device, ``differentiable=True``), the caller's own ``kwargs`` as they are."""
    wanted = optimizer_kwargs_for(optimizer_class, kwargs)
    if wanted.keys() == kwargs.keys():
        return optimizer_class(groups, **kwargs)
    try:  # copies: torch fills each group dict with the defaults it was given, even when it then refuses them
        return optimizer_class([dict(g) for g in groups], **wanted)
    except RuntimeError:  # torch: "`fused=True` requires ...", "`fused` does not support `differentiable`"
        return optimizer_class([dict(g) for g in groups], **kwargs)


def _by_size(bucket_bytes: int, reduce_dtype: torch.dtype) -> Grouping:
    """The stage-1/2 bucketing: buckets of at most ``bucket_bytes`` bytes of ``reduce_dtype`` (the gradient buffers)."""
    reduce_size = torch.empty((), dtype=reduce_dtype).element_size()
    return functools.partial(size_groups, bucket_bytes=bucket_bytes, elem_size=lambda p: reduce_size)


def _assign_groups(
    named: list[tuple[str, nn.Parameter]], param_groups: Sequence[dict[str, Any]] | None
) -> tuple[dict[nn.Parameter, int], list[dict[str, Any]]]:
    """Map every trainable parameter to its group index; return the groups' options (without ``params``)."""
    if param_groups is None:
        return {p: 0 for _, p in named}, [{}]
    group_of: dict[nn.Parameter, int] = {}
    options = []
    for gi, g in enumerate(param_groups):
        options.append({k: v for k, v in g.items() if k != "params"})
        for p in g["params"]:
            if p in group_of:
                raise UsageError(f"a parameter appears in param_groups {group_of[p]} and {gi}")
            group_of[p] = gi
    missing = [n for n, p in named if p not in group_of]
    if missing:
        raise UsageError(f"trainable parameters missing from param_groups: {', '.join(missing[:5])}")
    return group_of, options


def _compute_dtypes(module: nn.Module, policy: PrecisionPolicy) -> dict[int, torch.dtype]:
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


def _keep_fp32_hooks(module: nn.Module, policy: PrecisionPolicy) -> list[Any]:
    """Under a low-precision policy: every module the policy keeps in fp32 gets its floating-point inputs cast up to
    fp32 and its floating-point outputs cast back down to ``param_dtype`` (handles, to remove them)."""
    if policy.param_dtype == torch.float32:
        return []
    handles = []
    down = _caster(policy.param_dtype)
    for m in module.modules():
        if isinstance(m, policy.fp32_modules):
            handles.append(m.register_forward_pre_hook(_input_caster(torch.float32), with_kwargs=True))
            handles.append(m.register_forward_hook(lambda mod, args, out: tree_map(down, out)))
    return handles


def _caster(dtype: torch.dtype) -> Callable[[Any], Any]:
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return cast


def _input_caster(dtype: torch.dtype) -> Callable[..., Any]:
    cast = _caster(dtype)

    def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
