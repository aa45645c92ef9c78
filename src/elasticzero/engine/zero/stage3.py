"""ZeRO stage 3: optimizer state, gradients and parameters sharded.

The module is split into *units* (``units=``; default: every module that directly owns a trainable parameter, plus the
root). Each unit's parameters form one flat bucket; between uses the module's parameters are views into a flat
buffer whose storage is freed (``untyped_storage().resize_(0)``), so the module holds nothing but this rank's fp32
master shard (kept by the optimizer). Before a unit's forward its bucket is all-gathered into that storage (the
views, and whatever autograd saved from them, see the data again), after it the storage is freed; before the unit's
backward (a hook on its outputs' gradients) it is gathered again, and once every parameter of the unit has its
gradient the storage is freed. The gradient buckets are reduce-scattered at the end of backward, in the fixed
reverse-bucket order of :class:`GradBucketer`: when a bucket is complete depends on the rank (a parameter unused on
one rank gets its zero gradient only at the end there), and launching it then would interleave it differently with
the all-gathers on each rank (a hang). The next unit is prefetched with an async all-gather: in forward, the order
units started their forward; in backward, the reverse of the order they finished it (both recorded on the first
iteration, identical on every rank).

Activation checkpointing works: a unit recomputed inside backward keeps its parameters gathered until its gradients
are done. A parameter shared by several modules (tied weights) belongs to the nearest unit enclosing all of them
(often the root), so it stays gathered through that unit's forward and is gathered once per pass, never twice.

Under ``torch.compile`` (each unit compiled with ``block.compile()``, or ``torch.compile(model)``) the hooks run
eagerly between the graphs (:func:`~elasticzero.engine.zero.eager.outside_graph`), and while a unit's forward runs,
the entry-point hooks of the submodules inside it are detached (:meth:`ZeroStage3._enter`), so a compiled unit traces
as one graph with no hooked submodule in it (docs/engine.md, "torch.compile").

Held per rank (Ψ trainable elements, N ranks, fp32 Adam): fp32 master shard 4Ψ/N, fp32 gradient shard 4Ψ/N, Adam
8Ψ/N — 8 bytes/param at N=2 — plus the units being used and, during backward, the gradient buckets filled so far
(up to Ψ elements of ``reduce_dtype`` at the end of backward, freed as they are reduce-scattered). Frozen parameters
are not sharded (every rank keeps them whole). Communication per step: all-gather Ψ (forward) + all-gather Ψ
(backward) + reduce-scatter Ψ = 3Ψ (2Ψ with ``reshard_after_forward=False``, at the memory cost of keeping every unit
gathered from its forward to its backward).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from elasticzero.engine import hf
from elasticzero.engine.bucketer import GradBucketer, phase
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.eager import outside_graph
from elasticzero.engine.zero.flat import FlatBucket, Named, flatten_into, view_params_into
from elasticzero.engine.zero.host import Offloader
from elasticzero.engine.zero.options import UnitSpec, ZeroOptions
from elasticzero.errors import UsageError


class ZeroStage3(ZeroOptimizer):
    """ZeRO-3 optimizer wrapper (arguments of :class:`~elasticzero.engine.zero.base.ZeroOptimizer`, plus these
    :class:`~elasticzero.engine.zero.options.ZeroOptions` fields of stage 3 only):

    Args:
        units: which submodules are gathered/freed as one unit: a module class (or tuple of classes), a predicate
            ``f(module) -> bool``, or module instances (one, an iterable, or an ``nn.ModuleList`` of them); the root
            is always a unit and owns every parameter not inside another unit.
            Default: every element of every ``nn.ModuleList`` in the model (transformer blocks, as one would
            ``fully_shard`` them); a model without a ``ModuleList`` gets one unit per module owning a trainable
            parameter directly.
        reshard_after_forward: free each unit after its forward (3Ψ traffic) or keep it until its backward (2Ψ).
        prefetch: all-gather the next unit asynchronously while the current one computes.
        prefetch_bytes: keep prefetching further units while their total stays under this many bytes (0: one).

    After ``step()`` the module holds only freed views: ``module.state_dict()`` and ``module.load_state_dict()``
    raise :class:`~elasticzero.errors.UsageError`; use :meth:`full_state_dict` / :meth:`load_full_state_dict`.
    ``no_sync`` is not available (gradients are sharded as they are produced; ``supports_no_sync`` is False, so
    :class:`~elasticzero.engine.accumulation.GradAccumulation` uses a plain context instead).
    """

    stage = 3
    supports_no_sync = False
    keeps_whole_params = False  # between uses a parameter's storage is freed: a new optimizer would read nothing
    sit_out_refused = "stage 3's forward gathers every unit's parameters from every rank: no rank can sit a step out"

    def __init__(
        self,
        module: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        options: ZeroOptions | None = None,
        **kwargs: Any,
    ) -> None:
        options, kwargs = ZeroOptions.split(kwargs, self.stage, options)
        plan = UnitPlan.of(module, _normalize_units(options.units))
        super().__init__(module, optimizer_class, options=options, grouping=plan.groups, **kwargs)
        self.reshard_after_forward = options.reshard_after_forward
        self.prefetch = options.prefetch
        self.prefetch_bytes = options.prefetch_bytes
        self._needed: dict[str, list[int]] = {"": []}  # unit -> its buckets (the root always: it frees the unused)
        for b in self.buckets:
            self._needed.setdefault(plan.unit_of[id(b.params[0])], []).append(b.index)
        self._gathers = [_GatherState(full) for full in self._flat]  # per bucket
        self._fwd_order: list[str] = []
        self._fwd_index: dict[str, int] = {}
        self._bwd_order: list[str] = []  # reverse order of forward completion
        self._bwd_index: dict[str, int] = {}
        self._order_frozen = False
        self._bwd_callback_queued = False
        self._in_root = False  # the root's forward is in progress: the only time the unit order is recorded
        self._entries: list[str] = []  # submodules called directly whose forward is in progress (see _pre_entry)
        self._entry_buckets = self._entry_points()
        self._interior = _interiors(self._entry_buckets, self._needed)  # unit -> entry points it makes redundant
        self._active: dict[str, int] = {}  # unit -> its forwards in progress (entry hooks of its interior detached)
        self._modules = dict(module.named_modules())
        self._entry_handles: dict[str, tuple[Any, Any]] = {}
        self._hook_handles = self._install_hooks()
        for name in self._entry_buckets:
            self._attach_entry(name)
        hf.mark_sharded(module)  # HF generate() then keeps ranks in lock step (synced_gpus) by itself

    def release(self) -> None:
        """The base's, and every unit's and entry point's forward hooks."""
        super().release()
        for handle in self._hook_handles:
            handle.remove()
        for name in list(self._entry_handles):
            self._detach_entry(name)

    def _install_hooks(self) -> list[Any]:
        """Every unit's forward hooks (gather/free), run outside any compiled graph; their handles."""
        handles = []
        for name in self._needed:
            m = self._modules[name]
            handles.append(m.register_forward_pre_hook(outside_graph(functools.partial(self._pre_forward, name))))
            handles.append(m.register_forward_hook(outside_graph(functools.partial(self._post_forward, name))))
        return handles

    def _attach_entry(self, name: str) -> None:
        """Give entry point ``name`` its hooks (see :meth:`_pre_entry`), outside any compiled graph (idempotent)."""
        if name in self._entry_handles:
            return
        m = self._modules[name]
        pre, post = (outside_graph(functools.partial(h, name)) for h in (self._pre_entry, self._post_entry))
        self._entry_handles[name] = (
            m.register_forward_pre_hook(pre, prepend=True),
            m.register_forward_hook(post, always_call=True),
        )

    def _detach_entry(self, name: str) -> None:
        for handle in self._entry_handles.pop(name, ()):
            handle.remove()

    def _enter(self, unit: str) -> None:
        """``unit``'s forward starts: detach the entry hooks of its interior. Inside it they would find everything
        gathered anyway, and a module with hooks inside a compiled unit splits its graph and, with hook ids that
        differ per block, recompiles the block's shared code for every block (see docs/engine.md, torch.compile)."""
        depth = self._active.get(unit, 0)
        self._active[unit] = depth + 1
        if depth == 0:
            for name in self._interior.get(unit, ()):
                self._detach_entry(name)

    def _leave(self, unit: str) -> None:
        depth = self._active.pop(unit, 0) - 1
        if depth > 0:
            self._active[unit] = depth
            return
        for name in self._interior.get(unit, ()):
            self._attach_entry(name)

    def _reattach_entries(self) -> None:
        """Re-attach what a forward that raised left detached (called when the root's forward starts)."""
        for unit in list(self._active):
            self._active[unit] = 1
            self._leave(unit)

    # -- layout ------------------------------------------------------------------------------------------------
    def _entry_points(self) -> dict[str, list[int]]:
        """Submodule name -> the buckets it uses that no unit inside it gathers (they belong to an enclosing unit,
        often the root: its own parameters, tied ones): what a direct call of the submodule must gather itself."""
        bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        unit_of = self.unit_of_bucket()
        out: dict[str, list[int]] = {}
        for name, m in self.module.named_modules():
            idx = {bucket_of[id(p)] for p in m.parameters() if id(p) in bucket_of}
            idx = {i for i in idx if unit_of[i] != name and not unit_of[i].startswith(name + ".")}
            if name and idx:
                out[name] = sorted(idx)
        return out

    def _materialize(self, bucket: FlatBucket) -> tuple[nn.Parameter, torch.Tensor]:
        """The master and the full buffer (``param_dtype``) the module's parameters view, its storage freed."""
        lo, hi = bucket.shard_range()
        fp32 = torch.empty(bucket.padded_numel, dtype=torch.float32, device=self.device)
        flatten_into(bucket, fp32)
        master = nn.Parameter(fp32[lo:hi].clone())
        full = torch.empty(bucket.padded_numel, dtype=self._compute_dtype_of(bucket), device=self.device)
        view_params_into(bucket, full)
        full.untyped_storage().resize_(0)
        return master, full

    def _gather_params(self) -> None:
        """After ``step()``: drop every unit still gathered (its data predates the update, e.g. kept by a forward
        without backward under ``reshard_after_forward=False``); the next forward re-gathers from the masters."""
        for b in self.buckets:
            self._free(b)
            self._gathers[b.index].users = 0

    def _make_bucketer(self) -> GradBucketer:
        return self._reduce_scatter_bucketer(
            on_ready=self._on_ready,
            keep_buffers=False,
            launch_in_backward=False,  # all-gathers run during backward: keep the collective order rank-independent
        )

    # -- gather / free (collectives by the communicator) ---------------------------------------------------------------
    def _gather(self, b: FlatBucket) -> None:
        """Start the all-gather of bucket ``b`` into its (re-allocated) storage unless already gathered."""
        g = self._gathers[b.index]
        if g.gathered:
            return
        full = g.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        lo, hi = b.shard_range()
        chunk = full[lo:hi]
        source = self._shard_source(b.index)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
            chunk.copy_(source, non_blocking=source.is_pinned())
            work = self.communicator.all_gather(full, chunk, async_op=True)
        g.gathered, g.work = True, work

    def _shard_source(self, index: int) -> torch.Tensor:
        """What bucket ``index``'s gather copies into its chunk: the master (on the device); offloaded, the device
        copy of the shard its step pushed (the current stream waits for the push), or with ``params`` offloaded the
        host shard itself (page-locked: the copy does not block the host)."""
        if not self.home(index).host:
            return self.masters[index]
        offloader = self._offload
        assert offloader is not None
        if self.home(index).params_on_host:
            return offloader.source(index)
        offloader.order(index)
        return self._device_shards[index]

    def _bind_offload(self, offloader: Offloader) -> None:
        """Without ``params`` offloaded, an offloaded bucket keeps a compute-dtype copy of its shard on the device
        (what its gathers read; a step pushes into it); with them, none (gathers copy from the host)."""
        self._device_shards: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            home = self.home(b.index)
            if home.host and not home.params_on_host:
                shard = torch.empty(b.shard_numel, dtype=self._compute_dtype_of(b), device=self.device)
                self._device_shards[b.index] = shard
                offloader.push_into(b.index, shard)

    def _wait(self, b: FlatBucket) -> None:
        g = self._gathers[b.index]
        if g.work is not None:
            with phase(self.timers, "allgather"):
                g.work.wait()
            g.work = None

    def _free(self, b: FlatBucket) -> None:
        g = self._gathers[b.index]
        if not g.gathered:
            return
        self._wait(b)
        g.full.untyped_storage().resize_(0)
        g.gathered = False

    def _use(self, unit: str) -> None:
        for i in self._needed[unit]:
            self._gather(self.buckets[i])
        for i in self._needed[unit]:
            self._wait(self.buckets[i])

    def _prefetch(self, unit: str, order: list[str], index: dict[str, int]) -> None:
        """Start gathering the unit(s) after ``unit`` in ``order`` (recorded on the first iteration)."""
        if not (self.prefetch and self._order_frozen and unit in index):
            return
        j, budget = index[unit] + 1, self.prefetch_bytes
        while j < len(order):
            nbytes = 0
            for i in self._needed[order[j]]:
                b = self.buckets[i]
                nbytes += b.padded_numel * self._gathers[i].full.element_size()
                self._gather(b)
            budget -= nbytes
            j += 1
            if budget <= 0:
                break

    # -- module hooks ------------------------------------------------------------------------------------------------
    def _pre_forward(self, unit: str, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            # recomputation inside backward (activation checkpointing; torch may abort it midway, so no post hook is
            # guaranteed): gather and leave freeing to the gradient hooks / end of backward
            self._use(unit)
            return
        if unit == "":  # the outermost call
            self._in_root = True
            self._entries.clear()  # forget an entry an exception left unfinished
            self._reattach_entries()
        if not self._order_frozen and self._in_root and unit not in self._fwd_index:
            self._fwd_index[unit] = len(self._fwd_order)
            self._fwd_order.append(unit)
        self._use(unit)
        for i in self._needed[unit]:
            self._gathers[i].users += 1
        self._enter(unit)
        self._prefetch(unit, self._fwd_order, self._fwd_index)

    def _post_forward(self, unit: str, module: nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward (see _pre_forward): its backward needs the params now
        self._leave(unit)
        for i in self._needed[unit]:
            self._gathers[i].users -= 1
        if (
            not self._order_frozen and self._in_root and unit not in self._bwd_index
        ):  # backward visits units in reverse of this
            self._bwd_order.insert(0, unit)
            self._bwd_index = {u: k for k, u in enumerate(self._bwd_order)}
        # without grad no backward will come to free the unit: reshard now even with reshard_after_forward=False
        reshard = self.reshard_after_forward or not torch.is_grad_enabled()
        for i in self._needed[unit]:
            if self._gathers[i].users == 0 and reshard:
                self._free(self.buckets[i])
        if unit == "" and reshard:
            for b in self.buckets:  # prefetched but unused
                if self._gathers[b.index].users == 0:
                    self._free(b)
        if unit == "":
            self._in_root = False
            self.communicator.settle()  # the script may end after a forward (evaluation): see Communicator.settle
        if torch.is_grad_enabled():
            _on_first_grad(output, functools.partial(self._pre_backward, unit))

    def _pre_entry(self, name: str, module: nn.Module, args: Any) -> None:
        """A submodule called directly (``model.encoder(x)``; HF encoder-decoder ``generate()`` calls
        ``model.get_encoder()(...)``) or from a unit that does not own it: gather what its own units do not (the
        enclosing units' buckets it uses, e.g. a tied embedding owned by the root) until it returns."""
        if torch._C._current_graph_task_id() != -1 or self._all_ready(self._entry_buckets[name]):
            return  # inside a unit's (or the root's) forward that gathered them, or a recomputation in backward
        self._entries.append(name)
        self._use_buckets(self._entry_buckets[name])

    def _post_entry(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if not self._entries or self._entries[-1] != name:
            return
        self._entries.pop()
        idx = self._entry_buckets[name]
        for i in idx:
            self._gathers[i].users -= 1
        if self.reshard_after_forward or not torch.is_grad_enabled():
            for b in self.buckets:  # its own and any prefetched but unused
                if self._gathers[b.index].users == 0:
                    self._free(b)
        self.communicator.settle()
        if torch.is_grad_enabled() and output is not None:
            _on_first_grad(output, functools.partial(self._pre_backward_buckets, idx))

    def _all_ready(self, idx: list[int]) -> bool:
        return all(self._gathers[i].gathered and self._gathers[i].work is None for i in idx)

    def _use_buckets(self, idx: list[int]) -> None:
        for i in idx:
            self._gather(self.buckets[i])
        for i in idx:
            self._wait(self.buckets[i])
            self._gathers[i].users += 1

    def _pre_backward_buckets(self, idx: list[int]) -> None:
        if not self._bwd_callback_queued:
            self._bwd_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        for i in idx:
            self._gather(self.buckets[i])
        for i in idx:
            self._wait(self.buckets[i])

    def _pre_backward(self, unit: str) -> None:
        if not self._bwd_callback_queued:
            self._bwd_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        self._use(unit)
        self._prefetch(unit, self._bwd_order, self._bwd_index)

    def _on_ready(self, b: FlatBucket) -> None:
        if self._gathers[b.index].users == 0:
            self._free(b)

    def _on_reduced(self, bucket: FlatBucket, shard: torch.Tensor) -> None:
        master = self.masters[bucket.index]
        if self.home(bucket.index).host:
            self._offload.reduced(bucket.index, shard)  # type: ignore[union-attr]
            return
        if master.grad is None:
            master.grad = shard if shard.dtype == torch.float32 else shard.float()
        else:
            master.grad.add_(shard)

    def _post_backward(self) -> None:
        self._bwd_callback_queued = False
        self._order_frozen = self._order_frozen or bool(self._fwd_order)  # recorded by a root forward
        for b in self.buckets:
            if self._gathers[b.index].users == 0:
                self._free(b)
        self.communicator.settle()

    # -- module state dict: refused (the module holds freed views) ----------------------------------------------
    def _register_state_dict_hooks(self) -> list[RemovableHandle]:
        return [
            self.module.register_state_dict_pre_hook(self._refuse_state_dict),
            self.module.register_load_state_dict_pre_hook(self._refuse_load_state_dict),
        ]

    def _refuse_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self._own_module_state_dict:
            raise UsageError(
                "module.state_dict() under ZeroStage3 would return freed (0-byte) parameters: use "
                "opt.full_state_dict() (collective; the full fp32 state on every rank); to export a Hugging Face "
                "model: elasticzero.engine.hf.save_pretrained(model, opt, directory)"
            )

    def _refuse_load_state_dict(self, module: nn.Module, *args: Any) -> None:
        raise UsageError(
            "module.load_state_dict() under ZeroStage3 would write into freed parameters: use "
            "opt.load_full_state_dict(state_dict) (fills this rank's master shards)"
        )

    # -- API differences ---------------------------------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Not available on stage 3 (gradients are reduce-scattered as they are produced)."""
        raise UsageError("ZeroStage3 has no no_sync(): accumulate by calling backward repeatedly")

    def unit_of_bucket(self) -> dict[int, str]:
        """Bucket index -> name of the unit (module) that gathers it."""
        return {i: u for u, idx in self._needed.items() for i in idx}


class _Work(Protocol):
    def wait(self) -> Any: ...


@dataclass
class _GatherState:
    """Stage-3 state of one bucket: ``full``, the buffer its parameters view (storage freed while not gathered),
    whether it is ``gathered``, the all-gather in flight (``work``), and ``users``: forwards in progress using it."""

    full: torch.Tensor
    gathered: bool = False
    work: _Work | None = None
    users: int = 0


@dataclass(frozen=True)
class UnitPlan:
    """Which unit gathers each trainable parameter, decided from the module and the ``units=`` spec alone (before the
    optimizer exists): the stage-3 bucketing (one bucket per unit and bucket key)."""

    units: tuple[str, ...]  # module names of the units, in module order (the root, "", first)
    unit_of: dict[int, str]  # id(trainable parameter) -> its unit

    @classmethod
    def of(cls, module: nn.Module, spec: Any) -> UnitPlan:
        """A parameter belongs to the nearest unit enclosing every module that registers it (tied ones included)."""
        modules = list(module.named_modules())
        list_children = frozenset(id(c) for _, m in modules if isinstance(m, nn.ModuleList) for c in m)
        units = tuple(n for n, m in modules if _is_unit(spec, list_children, n, m))
        registered_by: dict[int, list[str]] = {}
        for mn, m in modules:
            for p in m._parameters.values():
                if p is not None and p.requires_grad:
                    registered_by.setdefault(id(p), []).append(mn)
        return cls(units, {pid: _enclosing(set(units), _common_prefix(ns)) for pid, ns in registered_by.items()})

    def groups(self, named: Named, key: Callable[[nn.Parameter], Hashable]) -> list[list[tuple[str, nn.Parameter]]]:
        """The buckets: per unit (in order), its parameters split by ``key`` (a :class:`~.flat.Grouping`)."""
        owned: dict[str, dict[Hashable, list[tuple[str, nn.Parameter]]]] = {u: {} for u in self.units}
        for name, p in named:
            owned[self.unit_of[id(p)]].setdefault(key(p), []).append((name, p))
        return [g for u in self.units for g in owned[u].values()]


def _is_unit(spec: Any, list_children: frozenset[int], name: str, m: nn.Module) -> bool:
    if name == "":
        return True
    if spec is None:
        if list_children:  # blocks of the model's nn.ModuleLists
            return id(m) in list_children
        return any(p is not None and p.requires_grad for p in m._parameters.values())
    if isinstance(spec, type) or (isinstance(spec, tuple) and all(isinstance(c, type) for c in spec)):
        return isinstance(m, spec)
    if isinstance(spec, frozenset):
        return id(m) in spec
    return bool(spec(m))


def _interiors(entries: dict[str, list[int]], units: Iterable[str]) -> dict[str, list[str]]:
    """Unit -> the entry points whose nearest unit strictly above them it is: while its forward runs, they find every
    bucket they use gathered (the buckets of that unit, and of the units above it, which its forward or its own entry
    hooks gathered)."""
    out: dict[str, list[str]] = {}
    unit_set = set(units)
    for name in entries:
        out.setdefault(_enclosing(unit_set, name.rpartition(".")[0]), []).append(name)
    return out


def _enclosing(units: set[str], module_name: str) -> str:
    """The unit ``module_name`` is in: itself or its nearest enclosing unit (the root at worst)."""
    while module_name not in units:
        module_name = module_name.rsplit(".", 1)[0] if "." in module_name else ""
    return module_name


def _on_first_grad(output: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` once, when the first gradient w.r.t. any tensor of ``output`` arrives in backward."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    fired = [False]

    def hook(grad: torch.Tensor) -> None:
        if not fired[0]:
            fired[0] = True
            fn()

    for t in tensors:
        t.register_hook(hook)


def _common_prefix(names: list[str]) -> str:
    """The deepest module name enclosing all ``names`` (``""`` is the root)."""
    parts = [n.split(".") if n else [] for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _normalize_units(spec: UnitSpec) -> Any:
    """None, a class / tuple of classes, a predicate, or a frozenset of module ids (instances, lists of them)."""
    if spec is None or isinstance(spec, type):
        return spec
    if isinstance(spec, tuple) and all(isinstance(c, type) for c in spec):
        return spec
    if isinstance(spec, nn.Module) and not isinstance(spec, nn.ModuleList):  # nn.Sequential is one unit
        return frozenset({id(spec)})
    if callable(spec) and not isinstance(spec, nn.Module):
        return spec
    return frozenset(id(m) for m in spec)  # type: ignore[union-attr]
