"""A ZeRO optimizer's model and optimizer state in a shape torch DCP reshards (N→M ranks, stage s→s').

:class:`ZeroCheckpointState` is the ``Stateful`` a checkpoint saves and loads: its ``state_dict()`` is the
optimizer's :meth:`~elasticzero.engine.zero.base.ZeroOptimizer.sharded_state` as the tree
:class:`~elasticzero.engine.zero.sharded.ShardedState` describes (per-parameter
:class:`~elasticzero.engine.zero.layout.FlatChunk` s, independent of buckets, world size and stage), with the state
an optimizer that has not stepped yet would have filled in. Loading checks the saved record against the optimizer's
:class:`~elasticzero.engine.zero.layout.ZeroLayout`, then copies into (or adopts, from :meth:`load_template`) the
masters, the optimizer state and the module.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.layout import FlatChunk, Piece
from elasticzero.engine.zero.sharded import FORMAT, ShardedState, is_shard_state, layout_record
from elasticzero.errors import UsageError

RUN_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})
"""Param-group options a load keeps from the live optimizer: how this run computes its step (its device, its torch,
the engine's fused default), not what was trained. A checkpoint saved before the fused default (``fused=None``) would
otherwise turn it off, and one saved fused on a GPU would ask for it where the live state lives elsewhere."""

__all__ = ["FORMAT", "ZeroCheckpointState"]


class ZeroCheckpointState:
    """``Stateful`` view of a ZeRO optimizer (model included) for :class:`~elasticzero.checkpoint.Checkpointer` or
    plain ``torch.distributed.checkpoint.save/load`` with the planners of :mod:`elasticzero.checkpoint.planner`.

    ``state_dict()`` returns views of the live tensors (not copies); ``load_state_dict`` validates names and shapes
    before touching anything, then copies into the masters, the optimizer state and the module — or adopts the
    buffers of a :meth:`load_template` it is given back — and (collective) refreshes the module's parameters from the
    masters.
    """

    def __init__(self, opt: ZeroOptimizer) -> None:
        self.opt = opt
        self._probed: dict[int, dict[str, Any]] = {}  # fresh state of masters without one (until a load fills it)
        # buffers load_template() made, by storage address: adoptable by load_state_dict while they live
        self._fresh: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    # -- save ---------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        states = _state_of(self.opt, self._probed)
        return self.opt.sharded_state(states=[states[m] for m in self.opt.masters]).state_dict()

    def load_template(self) -> dict[str, Any]:
        """What :meth:`state_dict` returns, every tensor a fresh uninitialised buffer, for a checkpoint to be read into
        (``torch.distributed.checkpoint.load`` in place) and then passed to :meth:`load_state_dict`.

        The chunks of each master and of each master-shaped optimizer state are views of one new buffer shaped like
        that master (its padding zeroed), so :meth:`load_state_dict` given this template back adopts the buffers as
        the optimizer's state (and as the masters where they own their storage) instead of copying: a resume
        allocates the state once and touches it once. Nothing live is touched until ``load_state_dict``."""
        inner, masters = self.opt.optim, self.opt.masters
        specs = _fresh_states(self.opt, [m for m in masters if not inner.state.get(m)], fill=False)
        buffers, states = [], []
        for b, m in zip(self.opt.buckets, masters, strict=True):
            spec = inner.state[m] if inner.state.get(m) else specs[m]
            flat = {k: torch.empty_like(v) for k, v in spec.items() if is_shard_state(v, m)}
            states.append({**{k: v for k, v in spec.items() if k not in flat}, **flat})
            buffers.append(torch.empty_like(m.detach()))
            for t in (buffers[-1], *flat.values()):
                _zero_padding(t, b.local_pieces())
                self._fresh[t.untyped_storage().data_ptr()] = t
        sd = self.opt.sharded_state(buffers, states).state_dict()
        sd["module"] = {k: torch.empty_like(v) for k, v in sd["module"].items()}
        return sd

    def layout(self) -> dict[str, Any]:
        """What the checkpoint records about this optimizer (also shown by ``elasticzero-checkpoint inspect``)."""
        return layout_record(self.opt.layout, self.opt.origin, self.opt.tied_aliases())

    # -- load ---------------------------------------------------------------------------------------------------------
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        loaded = ShardedState.from_state_dict(sd, self.opt.layout)
        here = len(self.opt.optim.param_groups)
        if len(loaded.param_groups) != here:
            raise UsageError(
                f"checkpoint has {len(loaded.param_groups)} optimizer parameter groups, this optimizer {here}"
            )
        with torch.no_grad():
            self._copy_in(loaded)
        self._probed.clear()
        self._fresh.clear()  # a template is consumed once
        self.opt.refresh_params()

    def _copy_in(self, loaded: ShardedState) -> None:
        opt, state = self.opt, loaded.optim_state
        for i, (b, m) in enumerate(zip(opt.buckets, opt.masters, strict=True)):
            inner, pieces = opt.optim.state[m], b.local_pieces()
            masters = [loaded.params[p.name] for p in pieces]
            keep = opt.master_views_params(i) or m.is_pinned()  # an offloaded master stays page-locked
            self._adopt_or_copy(m, masters, pieces, _constant(m), keep_storage=keep)
            if never_stepped(state, pieces):  # none here either: the first step makes it, as in a fresh optimizer
                opt.optim.state.pop(m, None)
                continue
            spec = inner or self._probed.get(id(m)) or _fresh_states(opt, [m], fill=False)[m]  # keys, no memory touched
            for k, v in list(spec.items()):
                if is_shard_state(v, m):  # where this rank owns only padding, a fresh state (no chunks)
                    chunks = [state[p.name][k] for p in pieces if k in state.get(p.name, {})]
                    inner[k] = self._adopt_or_copy(inner.get(k), chunks, pieces, _filler(self._filled, m, k))
                elif k not in inner:
                    inner[k] = v
            for k, by_name in loaded.scalars.items():  # a bucket of this layout takes them from its first parameter
                like, value = spec.get(k), by_name[b.names[0]]
                inner[k] = torch.tensor(value, dtype=like.dtype, device=like.device) if torch.is_tensor(like) else value
        for group, saved in zip(opt.optim.param_groups, loaded.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params" and k not in RUN_CHOICES})
        live = opt.module_state()
        for k, v in loaded.module.items():
            live[k].copy_(v)

    def _filled(self, master: torch.Tensor) -> dict[str, Any]:
        """A fresh optimizer state for ``master`` (cached: the one :meth:`state_dict` exposed, if it did)."""
        if id(master) not in self._probed:
            self._probed[id(master)] = _fresh_states(self.opt, [master], fill=True)[master]
        return self._probed[id(master)]

    def _adopt_or_copy(
        self,
        live: torch.Tensor | None,
        chunks: list[FlatChunk],
        pieces: Sequence[Piece],
        fresh: Callable[[], torch.Tensor],
        keep_storage: bool = False,
    ) -> torch.Tensor:
        """A tensor holding the loaded ``chunks`` (at the shard offsets of ``pieces``): the buffer they view when
        :meth:`load_template` made it (a master keeps its identity, its storage swapped, when it owns its storage);
        else ``live`` (or ``fresh()`` when there is none yet) with the chunks copied in. ``keep_storage``: ``live``
        shares its storage with the module's parameters (a view that may cover the whole buffer): always copy."""
        found = self._fresh.get(chunks[0].tensor.untyped_storage().data_ptr()) if chunks else None
        base = (  # the template buffer, when the chunks are exactly its elements
            found
            if found is not None
            and len(chunks) == len(pieces)
            and (live is None or found.shape == live.shape)
            and all(_views(c.tensor, found, p.shard_offset) for c, p in zip(chunks, pieces, strict=True))
            else None
        )
        if base is not None and isinstance(live, nn.Parameter):
            if not keep_storage and live.untyped_storage().nbytes() == live.numel() * live.element_size():
                live.data = base
                return live
        elif base is not None:
            return base
        target = live if live is not None else fresh()
        for c, p in zip(chunks, pieces, strict=True):
            target[p.shard_offset : p.shard_offset + p.end - p.start].copy_(c.tensor)
        return target


def never_stepped(state: dict[str, dict[str, FlatChunk]], pieces: Sequence[Piece]) -> bool:
    """The loaded optimizer state holds nothing for this bucket's ``pieces`` (some, not only padding): it was taken
    before the optimizer's first step — an in-memory reshard of a job that has not stepped yet (a node joined or left
    before step 1) hands no state keys (:func:`~elasticzero.live.reshard.reshard_from`)."""
    return bool(pieces) and not any(state.get(p.name) for p in pieces)


def _constant(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _filler(filled: Callable[[torch.Tensor], dict[str, Any]], master: torch.Tensor, key: str) -> Callable[[], Any]:
    """``filled(master)[key]``, when called (a fresh state, built only if a copy needs one)."""
    return lambda: filled(master)[key]


def _views(t: torch.Tensor, base: torch.Tensor, offset: int) -> bool:
    """Whether ``t`` is the elements of ``base`` (1-D, contiguous) starting at ``offset``."""
    same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return same and t.storage_offset() == base.storage_offset() + offset and t.dtype == base.dtype


def _zero_padding(flat: torch.Tensor, pieces: Sequence[tuple[str, int, int, int]]) -> None:
    """Zero the elements of a rank's shard ``flat`` that no parameter piece covers (bucket padding)."""
    at = 0
    for _, start, end, off in sorted(pieces, key=lambda p: p[3]):
        flat[at:off].zero_()
        at = off + end - start
    flat[at:].zero_()


def _state_of(opt: ZeroOptimizer, probed: dict[int, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The wrapped optimizer's state per master; for masters without state yet (before the first step), the state a
    fresh optimizer of the same class and options creates (:func:`_fresh_states`), built aside so the live optimizer
    is not touched. ``probed`` caches the latter by master id (the template and the load that follows need the
    same)."""
    inner = opt.optim
    states: dict[Any, dict[str, Any]] = {}
    missing = []
    for m in opt.masters:
        st = inner.state[m] if inner.state.get(m) else probed.get(id(m))
        if st is None:
            missing.append(m)
        else:
            states[m] = st
    for m, st in _fresh_states(opt, missing, fill=True).items():
        states[m] = probed[id(m)] = st
    return states


@torch.no_grad()
def _fresh_states(opt: ZeroOptimizer, masters: list[Any], *, fill: bool) -> dict[Any, dict[str, Any]]:
    """The state a fresh optimizer of ``opt``'s class and options has for each of ``masters`` after one step.

    torch DCP's convention (one step with zero gradients and lr 0), run on a one-element stand-in per master: a state
    tensor shaped like that stand-in becomes a tensor shaped like the master — filled with the stand-in's value (0 for
    Adam's moments) if ``fill``, else uninitialised (a buffer to load into) — others are kept, ``step`` counters
    reset to 0: for Adam/AdamW exactly a fresh state. A save of them restores a fresh optimizer."""
    if not masters:
        return {}
    inner = opt.optim
    stand_in = {id(m): torch.zeros(1, dtype=m.dtype, device=m.device, requires_grad=True) for m in masters}
    groups = []
    for g in inner.param_groups:
        ps = [stand_in[id(m)] for m in g["params"] if id(m) in stand_in]
        if ps:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "lr": 0.0, "params": ps})
    for c in stand_in.values():
        c.grad = torch.zeros_like(c)
    make: Callable[..., torch.optim.Optimizer] = type(inner)
    probe = make(groups)
    probe.step()
    return {m: {k: _grown(k, v, m, fill) for k, v in probe.state[stand_in[id(m)]].items()} for m in masters}


def _grown(key: str, v: Any, master: torch.Tensor, fill: bool) -> Any:
    """A stand-in's state value for ``master``: per-element tensors at the master's shape, ``step`` reset to 0."""
    if torch.is_tensor(v) and v.dim() == 1:
        if not fill:
            return torch.empty(master.shape, dtype=v.dtype, device=master.device)
        return torch.full(master.shape, v.item(), dtype=v.dtype, device=master.device)
    if key == "step":
        return torch.zeros_like(v) if torch.is_tensor(v) else 0
    return v
