"""A ZeRO optimizer's model and optimizer state in a shape torch DCP reshards (N→M ranks, stage s→s').

Every stage lays trainable parameters out in the same per-parameter flat index space: parameter ``name`` is a 1-D
tensor of ``numel`` elements, and this rank owns one contiguous range of it (``bucket.local_pieces()``). So the state
is expressed per parameter, as :class:`~elasticzero.checkpoint.chunks.FlatChunk` s at their offsets in the flattened
parameter — independent of buckets, world size and stage. Layout of :meth:`ZeroCheckpointState.state_dict`::

    {"params": {name: FlatChunk},                    # fp32 masters, this rank's range of each parameter
     "module": {key: Tensor},                        # frozen parameters and buffers (replicated)
     "optim":  {"state": {name: {"exp_avg": FlatChunk, "exp_avg_sq": FlatChunk}},
                "scalars": {"step": [[name, value], ...]},                  # per parameter, replicated
                "param_groups": {"0": {"lr": ..., "betas": ..., ...}, ...}},   # hyper-parameters, no "params"
     "layout": {"format": 1, "stage": s, "world_size": n, "precision": "bfloat16", "optimizer": "AdamW",
                "numel": ..., "shapes": [[name, [dims]], ...], "aliases": [[tied_name, name], ...]}}

Optimizer state tensors shaped like a master shard become chunks; the other values (Adam's 0-dim ``step``) are
stored for every parameter of the bucket as one list per key (replicated: all ranks agree; lists of plain values are
one DCP item each); a bucket of the new layout takes them from its first parameter.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from elasticzero.checkpoint.chunks import FlatChunk
from elasticzero.errors import UsageError

FORMAT = 1


class ZeroCheckpointState:
    """``Stateful`` view of a ZeRO optimizer (model included) for :class:`~elasticzero.checkpoint.Checkpointer` or
    plain ``torch.distributed.checkpoint.save/load`` with the planners of :mod:`elasticzero.checkpoint.planner`.

    ``state_dict()`` returns views of the live tensors (not copies); ``load_state_dict`` validates names and shapes
    before touching anything, then copies into the masters, the optimizer state and the module — or adopts the
    buffers of a :meth:`load_template` it is given back — and (collective) refreshes the module's parameters from the
    masters.
    """

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self._probed: dict[int, dict[str, Any]] = {}  # fresh state of masters without one (until a load fills it)
        # buffers load_template() made, by storage address: adoptable by load_state_dict while they live
        self._fresh: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    # -- save ---------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        states = _state_of(self.opt, self._probed)
        return self._assemble([m.detach() for m in self.opt.masters], [states[m] for m in self.opt.masters])

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
            flat = {k: torch.empty_like(v) for k, v in spec.items() if _is_shard_state(v, m)}
            states.append({**{k: v for k, v in spec.items() if k not in flat}, **flat})
            buffers.append(torch.empty_like(m.detach()))
            for t in (buffers[-1], *flat.values()):
                _zero_padding(t, b.local_pieces())
                self._fresh[t.untyped_storage().data_ptr()] = t
        sd = self._assemble(buffers, states)
        sd["module"] = {k: torch.empty_like(v) for k, v in sd["module"].items()}
        return sd

    def _assemble(self, masters: list[torch.Tensor], states: list[dict[str, Any]]) -> dict[str, Any]:
        """The state dict over ``masters`` (one flat tensor per bucket) and their optimizer ``states``."""
        opt = self.opt
        params: dict[str, FlatChunk] = {}
        state: dict[str, dict[str, FlatChunk]] = {}
        scalars: dict[str, list[list[Any]]] = {}  # one entry per key (few DCP items), identical on every rank
        for b, m, inner in zip(opt.buckets, masters, states, strict=True):
            _check_reshardable(inner, m)
            for k, v in inner.items():
                if not _is_shard_state(v, m):
                    scalars.setdefault(k, []).extend([n, v.item() if torch.is_tensor(v) else v] for n in b.names)
            for name, start, end, off in b.local_pieces():
                numel = opt.partition[name].numel
                params[name] = FlatChunk(m[off : off + end - start], start, numel)
                state[name] = {
                    k: FlatChunk(v[off : off + end - start], start, numel)
                    for k, v in inner.items()
                    if _is_shard_state(v, m)
                }
        return {
            "params": params,
            "module": _unmanaged_module_state(opt),
            "optim": {"state": state, "scalars": scalars, "param_groups": _group_options(opt)},
            "layout": self.layout(),
        }

    def layout(self) -> dict[str, Any]:
        """What the checkpoint records about this optimizer (also shown by ``elasticzero-checkpoint inspect``)."""
        opt = self.opt
        return {
            "format": FORMAT,
            "stage": opt.stage,
            "world_size": opt.world_size,
            "precision": str(opt.policy.param_dtype).removeprefix("torch."),
            "optimizer": type(opt.optim).__name__,
            "numel": opt.numel,
            "shapes": [[n, list(s.shape)] for n, s in opt.partition.items()],
            "aliases": [[alias, name] for alias, name in _tied_aliases(opt).items()],
        }

    # -- load ---------------------------------------------------------------------------------------------------------
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        _check_layout(sd["layout"], self.layout())
        groups = sd["optim"]["param_groups"]
        here = len(self.opt.optim.param_groups)
        if len(groups) != here:
            raise UsageError(f"checkpoint has {len(groups)} optimizer parameter groups, this optimizer {here}")
        with torch.no_grad():
            self._copy_in(sd)
        self._probed.clear()
        self._fresh.clear()  # a template is consumed once
        self.opt._gather_params()

    def _copy_in(self, sd: dict[str, Any]) -> None:
        opt, state = self.opt, sd["optim"]["state"]
        scalars = {k: dict(pairs) for k, pairs in sd["optim"]["scalars"].items()}
        for b, m in zip(opt.buckets, opt.masters, strict=True):
            inner, pieces = opt.optim.state[m], b.local_pieces()
            self._adopt_or_copy(m, [sd["params"][n] for n, *_ in pieces], pieces, None)
            spec = inner or self._probed.get(id(m)) or _fresh_states(opt, [m], fill=False)[m]  # keys, no memory touched
            for k, v in list(spec.items()):
                if _is_shard_state(v, m):  # where this rank owns only padding, a fresh state (no chunks)
                    chunks = [state[n][k] for n, *_ in pieces if k in state.get(n, {})]
                    inner[k] = self._adopt_or_copy(inner.get(k), chunks, pieces, lambda m=m, k=k: self._filled(m)[k])
                elif k not in inner:
                    inner[k] = v
            for k, by_name in scalars.items():  # a bucket of this layout takes them from its first parameter
                like, value = spec.get(k), by_name[b.names[0]]
                inner[k] = torch.tensor(value, dtype=like.dtype, device=like.device) if torch.is_tensor(like) else value
        for group, saved in zip(opt.optim.param_groups, sd["optim"]["param_groups"].values(), strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        live = _unmanaged_module_state(opt)
        for k, v in sd["module"].items():
            live[k].copy_(v)

    def _filled(self, master: torch.Tensor) -> dict[str, Any]:
        """A fresh optimizer state for ``master`` (cached: the one :meth:`state_dict` exposed, if it did)."""
        if id(master) not in self._probed:
            self._probed[id(master)] = _fresh_states(self.opt, [master], fill=True)[master]
        return self._probed[id(master)]

    def _adopt_or_copy(
        self, live: torch.Tensor | None, chunks: list[FlatChunk], pieces: list[Any], fresh: Any
    ) -> torch.Tensor:
        """A tensor holding the loaded ``chunks`` (at the shard offsets of ``pieces``): the buffer they view when
        :meth:`load_template` made it (a master keeps its identity, its storage swapped, when it owns its storage);
        else ``live`` (or ``fresh()`` when there is none yet) with the chunks copied in."""
        found = self._fresh.get(chunks[0].tensor.untyped_storage().data_ptr()) if chunks else None
        base = (  # the template buffer, when the chunks are exactly its elements
            found
            if found is not None
            and len(chunks) == len(pieces)
            and (live is None or found.shape == live.shape)
            and all(_views(c.tensor, found, p[3]) for c, p in zip(chunks, pieces, strict=True))
            else None
        )
        if base is not None and isinstance(live, nn.Parameter):
            if live.untyped_storage().nbytes() == live.numel() * live.element_size():
                live.data = base
                return live
        elif base is not None:
            return base
        target = live if live is not None else fresh()
        for c, (_, start, end, off) in zip(chunks, pieces, strict=True):
            target[off : off + end - start].copy_(c.tensor)
        return target


def _views(t: torch.Tensor, base: torch.Tensor, offset: int) -> bool:
    """Whether ``t`` is the elements of ``base`` (1-D, contiguous) starting at ``offset``."""
    same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return same and t.storage_offset() == base.storage_offset() + offset and t.dtype == base.dtype


def _zero_padding(flat: torch.Tensor, pieces: list[tuple[str, int, int, int]]) -> None:
    """Zero the elements of a rank's shard ``flat`` that no parameter piece covers (bucket padding)."""
    at = 0
    for _, start, end, off in sorted(pieces, key=lambda p: p[3]):
        flat[at:off].zero_()
        at = off + end - start
    flat[at:].zero_()


def _tied_aliases(opt: Any) -> dict[str, str]:
    """``{alias: name}`` for module state-dict keys that are tied to a trainable parameter saved under ``name``."""
    first = {id(p): n for b in opt.buckets for n, p in zip(b.names, b.params, strict=True)}
    with opt._reading_module_state():
        module_sd = opt.module.state_dict(keep_vars=True)
    return {k: first[id(v)] for k, v in module_sd.items() if id(v) in first and first[id(v)] != k}


def _is_shard_state(v: Any, master: torch.Tensor) -> bool:
    return torch.is_tensor(v) and v.shape == master.shape and v.dim() == 1


def _check_reshardable(inner: dict[str, Any], master: torch.Tensor) -> None:
    for k, v in inner.items():
        if torch.is_tensor(v) and v.dim() != 0 and not _is_shard_state(v, master):
            raise UsageError(
                f"optimizer state {k!r} has shape {tuple(v.shape)}: only 0-dim tensors and tensors shaped like the "
                f"master shard {tuple(master.shape)} can be resharded"
            )


def _group_options(opt: Any) -> dict[str, dict[str, Any]]:
    return {str(i): {k: v for k, v in g.items() if k != "params"} for i, g in enumerate(opt.optim.param_groups)}


def _unmanaged_module_state(opt: Any) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers of the module (tied aliases of trainable parameters excluded)."""
    managed = {id(p) for b in opt.buckets for p in b.params}
    with opt._reading_module_state():
        module_sd = opt.module.state_dict(keep_vars=True)
    return {k: v.detach() for k, v in module_sd.items() if id(v) not in managed}


def _state_of(opt: Any, probed: dict[int, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
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
def _fresh_states(opt: Any, masters: list[Any], *, fill: bool) -> dict[Any, dict[str, Any]]:
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
    probe = type(inner)(groups)
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


def _check_layout(saved: dict[str, Any], here: dict[str, Any]) -> None:
    if saved.get("format") != FORMAT:
        raise UsageError(f"ZeRO state format {saved.get('format')!r} is not supported (this version reads {FORMAT})")
    mine, theirs = dict(here["shapes"]), dict(saved["shapes"])
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if missing or extra:
        raise UsageError(
            f"checkpoint is of another model: parameters only here {missing[:3]}, only in the checkpoint {extra[:3]}"
        )
    for name, shape in mine.items():
        if list(theirs[name]) != shape:
            there = theirs[name]
            raise UsageError(f"checkpoint is of another model: {name} has shape {there} there, {shape} here")
