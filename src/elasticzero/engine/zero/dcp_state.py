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

from typing import Any

import torch

from elasticzero.checkpoint.chunks import FlatChunk
from elasticzero.errors import UsageError

FORMAT = 1


class ZeroCheckpointState:
    """``Stateful`` view of a ZeRO optimizer (model included) for :class:`~elasticzero.checkpoint.Checkpointer` or
    plain ``torch.distributed.checkpoint.save/load`` with the planners of :mod:`elasticzero.checkpoint.planner`.

    ``state_dict()`` returns views of the live tensors (not copies); ``load_state_dict`` validates names and shapes
    before touching anything, then copies into the masters, the optimizer state and the module, and (collective)
    refreshes the module's parameters from the masters.
    """

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self._probed: dict[int, dict[str, Any]] = {}  # fresh state of masters without one (until a load fills it)

    # -- save ---------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        opt = self.opt
        states = _state_of(opt, self._probed)
        params: dict[str, FlatChunk] = {}
        state: dict[str, dict[str, FlatChunk]] = {}
        scalars: dict[str, list[list[Any]]] = {}  # one entry per key (few DCP items), identical on every rank
        for b, m in zip(opt.buckets, opt.masters, strict=True):
            inner = states[m]
            _check_reshardable(inner, m)
            for k, v in inner.items():
                if not _is_shard_state(v, m):
                    scalars.setdefault(k, []).extend([n, v.item() if torch.is_tensor(v) else v] for n in b.names)
            for name, start, end, off in b.local_pieces():
                numel = opt.partition[name].numel
                params[name] = FlatChunk(m.detach()[off : off + end - start], start, numel)
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
        self.opt._gather_params()

    def _copy_in(self, sd: dict[str, Any]) -> None:
        opt, state = self.opt, sd["optim"]["state"]
        scalars = {k: dict(pairs) for k, pairs in sd["optim"]["scalars"].items()}
        fresh = _state_of(opt, self._probed)  # every key a master's state needs, also where this rank owns only padding
        for b, m in zip(opt.buckets, opt.masters, strict=True):
            inner = opt.optim.state[m]
            for k, v in fresh[m].items():
                if k not in inner:
                    inner[k] = v  # the probe's tensors were built aside for this (cleared below): adopt, no copy
            for k, by_name in scalars.items():  # a bucket of this layout takes them from its first parameter
                like = fresh[m].get(k)
                value = by_name[b.names[0]]
                inner[k] = torch.tensor(value, dtype=like.dtype, device=like.device) if torch.is_tensor(like) else value
            for name, start, end, off in b.local_pieces():
                m[off : off + end - start].copy_(sd["params"][name].tensor)
                for k, c in state.get(name, {}).items():
                    inner[k][off : off + end - start].copy_(c.tensor)
        for group, saved in zip(opt.optim.param_groups, sd["optim"]["param_groups"].values(), strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        live = _unmanaged_module_state(opt)
        for k, v in sd["module"].items():
            live[k].copy_(v)


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


@torch.no_grad()
def _state_of(opt: Any, probed: dict[int, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """The wrapped optimizer's state per master; for masters without state yet (before the first step), the state a
    fresh optimizer of the same class and options creates, built aside so the live optimizer is not touched.

    torch DCP's convention (one step with zero gradients and lr 0), run on a one-element stand-in per master: a state
    tensor shaped like that stand-in becomes a tensor shaped like the master filled with the stand-in's value (0 for
    Adam's moments), others are kept, ``step`` counters reset to 0 — for Adam/AdamW exactly a fresh state. A load
    needs these tensors to read into; a save of them restores a fresh optimizer. ``probed`` caches the result by
    master id (the template and the load that follows need the same)."""
    inner = opt.optim
    states: dict[Any, dict[str, Any]] = {}
    missing = []
    for m in opt.masters:
        st = inner.state[m] if inner.state.get(m) else probed.get(id(m))
        if st is None:
            missing.append(m)
        else:
            states[m] = st
    if not missing:
        return states
    stand_in = {id(m): torch.zeros(1, dtype=m.dtype, device=m.device, requires_grad=True) for m in missing}
    groups = []
    for g in inner.param_groups:
        ps = [stand_in[id(m)] for m in g["params"] if id(m) in stand_in]
        if ps:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "lr": 0.0, "params": ps})
    for c in stand_in.values():
        c.grad = torch.zeros_like(c)
    probe = type(inner)(groups)
    probe.step()
    for m in missing:
        states[m] = probed[id(m)] = {k: _grown(k, v, m) for k, v in probe.state[stand_in[id(m)]].items()}
    return states


def _grown(key: str, v: Any, master: torch.Tensor) -> Any:
    """A stand-in's state value for ``master``: per-element tensors at the master's shape, ``step`` reset to 0."""
    if torch.is_tensor(v) and v.dim() == 1:
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
