"""What ZeroStage1/2/3 share: parameter discovery, buckets, masters, the wrapped optimizer, clipping, unscaling and
the rank-local state dict. The state views and memory report are :class:`~elasticzero.engine.zero.views.ZeroStateViews`
(a base); the wrapped optimizer's making is :mod:`.inner`, the forward casts :mod:`.casting`, what gradient watchers
are told :mod:`.watch`. The stages differ in where gradients and parameters live (see each stage)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from elasticzero.engine.bucketer import GradBucketer, phase
from elasticzero.engine.precision import as_policy
from elasticzero.engine.zero import clip
from elasticzero.engine.zero.bindings import hold_params
from elasticzero.engine.zero.casting import compute_dtypes, input_caster, keep_fp32_hooks
from elasticzero.engine.zero.comm.communicator import Communicator
from elasticzero.engine.zero.eager import outside_graph
from elasticzero.engine.zero.flat import FlatBucket, Grouping, _device_of, layout_buckets, size_groups
from elasticzero.engine.zero.host import Offloader, offloader_for
from elasticzero.engine.zero.inner import assign_groups, build_optimizer
from elasticzero.engine.zero.layout import ParamSlot, ZeroLayout
from elasticzero.engine.zero.offload import BucketHome, check_stage, early_step_blocker
from elasticzero.engine.zero.options import ZeroOptions
from elasticzero.engine.zero.views import ZeroStateViews
from elasticzero.engine.zero.watch import Factor, GradWatcher
from elasticzero.errors import UsageError

__all__ = ["Factor", "GradWatcher", "ZeroOptimizer", "offloaded_step"]


class ZeroOptimizer(ZeroStateViews, torch.optim.Optimizer):
    """Base of the ZeRO stages: a ``torch.optim.Optimizer`` whose real work is done by ``optimizer_class`` built on
    this rank's fp32 master shards.

    Args:
        module: the model; its trainable parameters are re-laid out into flat buckets (identity of every
            ``nn.Parameter`` is kept, only ``.data`` changes). Frozen parameters are left alone (cast to the compute
            dtype under a low-precision policy).
        optimizer_class: any ``torch.optim.Optimizer`` class, e.g. ``torch.optim.AdamW``.
        param_groups: optional list of dicts ``{"params": [model parameters], **options}`` (like torch's); every
            trainable parameter must appear in exactly one. Default: one group with all of them.
        options: the stage's :class:`~elasticzero.engine.zero.options.ZeroOptions` (precision, bucket_bytes,
            process_group, ...; default: the defaults), which its fields given as keyword arguments override
            (``precision="bf16"``); kept as ``opt.options``, without its ``process_group`` (``opt.process_group``).
        grouping: how the trainable parameters form buckets (a stage's bucketing; stage 3 passes its units).
            Default: by ``bucket_bytes``, per param group, dtype and compute dtype, in registration order.
        **kwargs: the :class:`~elasticzero.engine.zero.options.ZeroOptions` fields, the rest passed to
            ``optimizer_class`` (``lr=...``, ``weight_decay=...``). Where they choose
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
    keeps_whole_params: bool = True
    """Whether the module's parameters hold their whole values between steps (stages 1/2; stage 3 frees them): after
    :meth:`release` the module can be wrapped again — a live survivor keeps its model across a round change."""
    sit_out_refused: str | None = None
    """Why no rank of this stage can sit a step out (:meth:`sit_out`), or None: it can."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        options: ZeroOptions | None = None,
        param_groups: Sequence[dict[str, Any]] | None = None,
        grouping: Grouping | None = None,
        **kwargs: Any,
    ) -> None:
        if not dist.is_initialized():
            raise UsageError(f"{type(self).__name__} needs torch.distributed initialised (init_process_group)")
        options, optimizer_kwargs = ZeroOptions.split(kwargs, self.stage, options)
        self.module = module
        self._communicator = Communicator(options.process_group, owner=type(self).__name__)
        # kept without the group: the communicator holds it weakly (opt.process_group), so that
        # destroy_process_group() can join its threads while this optimizer lives (tests/integration/engine/
        # test_shutdown.py)
        self.options = dataclasses.replace(options, process_group=None)
        self.world_size = self._communicator.size
        self.rank = self._communicator.rank
        self.policy = as_policy(self.options.precision)
        self.timers = self.options.timers
        self.bucket_bytes = self.options.bucket_bytes
        self.max_inflight = self.options.max_inflight

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError(f"{type(self).__name__}: the module has no trainable parameters")
        # before any collective: every flat buffer, master and scalar is allocated on this device
        self.device: torch.device = _device_of(p for _, p in named)
        self._group_of, group_options = assign_groups(named, param_groups)
        self._compute_dtype = compute_dtypes(module, self.policy)  # id(param) -> dtype of its compute copy
        if self.options.sync_module_states:
            self._broadcast_module()
        grouping = grouping or _by_size(self.bucket_bytes, self.policy.reduce_dtype)
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
        check_stage(self.options.offload, self.stage)
        shards = [b.shard_numel for b in self.buckets]
        self._offload = offloader_for(self.options.offload, self.device, shards, optimizer_class, optimizer_kwargs)
        made = [self._materialize(b) for b in self.buckets]
        self.masters: list[nn.Parameter] = [self._adopt(i, master) for i, (master, _) in enumerate(made)]
        self._flat: list[torch.Tensor] = [flat for _, flat in made]  # per bucket: the buffer its parameters view
        self._cast_frozen()
        # module.to()/.half(), param.data = ..., DDP, torch's clip: followed or refused (bindings.py, standin.py)
        self._bindings, self._stand_ins = hold_params(module, self.buckets, self._flat, type(self).__name__)

        inner_groups = []
        for gi, opts in enumerate(group_options):
            # a group whose parameters are all frozen stays, empty, so group indices match the user's (schedulers)
            masters = [self.masters[i] for i in self.layout.group_buckets(gi)]
            inner_groups.append({**opts, "params": masters})
        self.optim = build_optimizer(optimizer_class, inner_groups, optimizer_kwargs)
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
        self._reduced_in_step = False  # a gradient reduction since the last zero_grad (sit_out must come before)
        self.bucketer = self._make_bucketer()
        self._bound_hook = module.register_forward_pre_hook(outside_graph(self._before_forward), prepend=True)
        self._input_hook = None
        if self.options.cast_forward_inputs and self.policy.param_dtype != torch.float32:
            self._input_hook = module.register_forward_pre_hook(input_caster(self.policy.param_dtype), with_kwargs=True)
        self._fp32_hooks = keep_fp32_hooks(module, self.policy)
        self._own_module_state_dict = False  # set while full_state_dict/load_full_state_dict read the module
        self._state_dict_hooks = self._register_state_dict_hooks()

    def rewrappable(self) -> bool:
        """Whether :meth:`unwrap` can hand the module back as a model to wrap again: its parameters hold their whole
        values (:attr:`keeps_whole_params`) in their own dtype (fp32; under bf16/fp16 they are the low-precision
        compute copies, which a fresh wrap would take for the model's own)."""
        return self.keeps_whole_params and self.policy.param_dtype == torch.float32

    def unwrap(self, *, copy: bool = True) -> nn.Module:
        """The module, handed back as a plain model another optimizer can wrap (:meth:`rewrappable`); this optimizer
        released (:meth:`release`) and not used again.

        ``copy=True``: every tensor of the module is given storage of its own holding its current values — the
        managed parameters no longer view this optimizer's flat buffers, and the frozen parameters and buffers are no
        longer the tensors :meth:`sharded_state` read as the module's state. What was read meanwhile stays exactly as
        it is, whatever the next wrap writes into the module (its broadcast of the module from its group's rank 0).
        Costs one copy of the module.

        ``copy=False``: the module stays as it is, its parameters lying flat in this optimizer's buffers, which the
        next stage-1/2 wrap of it takes over in place (:func:`~.flat.lying_flat`: no copy, no new memory, at any world
        up to twice and one more than this one). The masters and the module's state read from this optimizer are
        then written by that wrap — its broadcast, a load into it: detach what must outlive it first (a live
        survivor's held state, :meth:`ShardedState.detached <.sharded.ShardedState.detached>`)."""
        if not self.rewrappable():
            raise UsageError(
                f"{type(self).__name__}.unwrap(): its parameters are not whole fp32 values (stage 3 frees them, "
                "bf16/fp16 hold compute copies): build a fresh model instead"
            )
        self.release()
        if copy:
            with torch.no_grad():
                for t in [*self.module.parameters(), *self.module.buffers()]:
                    t.data = t.detach().clone()
        return self.module

    def release(self) -> None:
        """Take every hook this optimizer put on its module and its parameters off; the optimizer is not used again.

        For the owner of a model it is done with while the process goes on — a live round change drops the old
        round's model and optimizer. A parameter's post-accumulate-grad hook (the bucketer's) is held by autograd's
        C++ node, an edge Python's collector cannot see: without this, that hook keeps the optimizer, its masters and
        state and the whole model alive for good (~5x the model's fp32 size per round, measured).

        The managed parameters' gradients go too (stand-ins, views of this optimizer's buffers), so that a new
        optimizer can wrap the same module (:attr:`keeps_whole_params`). Idempotent."""
        self.bucketer.remove()
        for handle in (self._bound_hook, self._input_hook, *self._fp32_hooks, *self._state_dict_hooks):
            if handle is not None:
                handle.remove()
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    # -- stage hooks (overridden; those called while constructing read only what the base set before) -----------
    def _communicator_replaced(self, new: Communicator) -> None:
        self.bucketer.communicator = new

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
        in host memory), and torch's clip_grad_norm_ on the module now raises (the gradient stand-ins, standin.py)."""
        if self._offload is not None:
            self._offload.end_backward()
        self._stand_ins.post()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """The root module's first forward pre-hook: the gradient stand-ins go (autograd must not accumulate into
        them), and every parameter must still be the engine's (:meth:`~.bindings.ParamBindings.check`)."""
        self._stand_ins.lift()
        self._bindings.check(f"{type(module).__name__}.forward")

    def _reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        """The bucketer's ``on_reduced``: the stage's :meth:`_on_reduced`, between telling the watchers."""
        self._reduced_in_step = True
        watchers = list(self._grad_watchers.values())
        for w in watchers:
            w.grads_changing(bucket.index)
        self._on_reduced(bucket, shard)
        if watchers and self._offload is not None and self.home(bucket.index).host:
            self._offload.settle(bucket.index)  # the watchers read the host gradient
        grad = self.masters[bucket.index].grad
        if grad is not None:  # every stage sets it here
            for w in watchers:
                w.grad_reduced(bucket.index, grad)

    def _on_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        raise NotImplementedError

    def _register_state_dict_hooks(self) -> list[RemovableHandle]:
        """Hooks on ``module.state_dict`` / ``module.load_state_dict`` (stages 1/2: keep masters in sync; 3: refuse);
        their handles (:meth:`release` removes them)."""
        return []

    # -- torch.optim.Optimizer API ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step on this rank's master shards, then (stages 1/2) all-gather the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._bindings.check("opt.step()")  # a step of masters the module no longer views would train nothing
        with phase(self.timers, "step"):
            if self._offload is None:
                self.optim.step()
            else:  # bucket by bucket, the offloaded ones on the host, each pushed as it steps
                offloaded_step(self.optim, self._offload)
        with phase(self.timers, "allgather"):
            self._gather_params()
        return loss

    @contextlib.contextmanager
    def stepping_in_backward(self, *, clipping: bool = False, loss_scaling: bool = False) -> Iterator[str | None]:
        """Around the backward that ends an optimizer step: each offloaded bucket takes its step on the host as soon
        as its gradient lands, overlapped with the rest of backward; :meth:`step` then steps what is left and waits.
        Only where :func:`~elasticzero.engine.zero.offload.early_step_blocker` allows it (no clipping, no loss
        scaler, no gradient watcher); yields why not (None: armed). Without offloaded buckets it does nothing."""
        watched = bool(self._grad_watchers)
        reason = early_step_blocker(armed=True, clipping=clipping, loss_scaling=loss_scaling, watched=watched)
        if self._offload is None:
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
        self._reduced_in_step = False
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

    def sit_out(self) -> None:
        """This rank's part in a step it computes nothing for (no forward, no backward): the step's gradient
        reductions with zeros for its own gradients, every bucket in the order the other ranks launch theirs, so its
        shard gets their reduced gradients and :meth:`step` follows as on every rank. The ranks that compute the step
        run their backward inside :meth:`contributing`, with their own number: the mean is theirs (a step with one
        rank sitting out is then the step of the others alone: x + 0 is x). Call it where the backward would be, after
        ``zero_grad()``; the others reduce once in the step, as they do when they accumulate their micro-batches
        under :meth:`no_sync` (:class:`~elasticzero.engine.accumulation.GradAccumulation` does): one backward outside
        it is one round of reductions, which is what a rank sitting out issues.

        Raises :class:`~elasticzero.errors.UsageError` on stage 3 (:attr:`sit_out_refused`), in a one-rank group,
        and after a reduction in this step (a backward ran: the others would wait for a second round of reductions)."""
        name = f"{type(self).__name__}.sit_out()"
        if self.sit_out_refused is not None:
            raise UsageError(f"{name}: {self.sit_out_refused}")
        if self.world_size == 1:
            raise UsageError(f"{name}: a one-rank group has no other rank to compute the step")
        if self._reduced_in_step:
            raise UsageError(
                f"{name} after this step's gradients were reduced: call it instead of the backward, after zero_grad()"
            )
        self.bucketer.finalize()

    def contributing(self, ranks: int) -> contextlib.AbstractContextManager[None]:
        """Average the gradients of the backward inside over ``ranks`` ranks instead of the world size: the step's
        other ranks sit it out (:meth:`sit_out`). Refused where no rank can (:attr:`sit_out_refused`)."""
        if self.sit_out_refused is not None:
            raise UsageError(f"{type(self).__name__}.contributing(): {self.sit_out_refused}")
        return self.bucketer.contributing(ranks)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without communicating until the first backward outside the context.

        Memory trade-off: the full gradient (Ψ elements of ``reduce_dtype``) is held until that backward, i.e. stage 2
        gives up its gradient sharding for the accumulation window (stage 1 holds a full gradient anyway, so it costs
        nothing there). Saves ``accumulation_steps - 1`` reduce-scatters per step. Not available on stage 3.
        """
        return self.bucketer.no_sync()

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


@torch.optim.Optimizer.profile_hook_step
def offloaded_step(optim: torch.optim.Optimizer, offloader: Offloader) -> None:
    """The offloaded step stands for ``optim.step()`` (each bucket steps its own optimizer over ``optim``'s shared
    state): torch's decorator runs ``optim``'s step pre- and post-hooks around it as ``optim.step()`` would (the buddy
    copies' hooks, live/copies.py: without them no copy steps, and the census counts no step)."""
    offloader.step()


def _by_size(bucket_bytes: int, reduce_dtype: torch.dtype) -> Grouping:
    """The stage-1/2 bucketing: buckets of at most ``bucket_bytes`` bytes of ``reduce_dtype`` (the gradient buffers)."""
    reduce_size = torch.empty((), dtype=reduce_dtype).element_size()
    return functools.partial(size_groups, bucket_bytes=bucket_bytes, elem_size=lambda p: reduce_size)
