"""A ZeRO optimizer's state as one rank holds it, per parameter: what a checkpoint writes, what a reshard moves.

Every stage lays trainable parameters out in the same per-parameter flat index space
(:class:`~elasticzero.engine.zero.layout.ZeroLayout`): parameter ``name`` is a 1-D tensor of ``numel`` elements and a
rank owns one contiguous range of it. So the state is expressed per parameter, as
:class:`~elasticzero.engine.zero.layout.FlatChunk` s at their offsets in the flattened parameter — independent of
buckets, world size and stage. :meth:`ShardedState.state_dict` is the tree a checkpoint stores (format 1)::

    {"params": {name: FlatChunk},                    # fp32 masters, this rank's range of each parameter
     "module": {key: Tensor},                        # frozen parameters and buffers (replicated)
     "optim":  {"state": {name: {"exp_avg": FlatChunk, "exp_avg_sq": FlatChunk}},
                "scalars": {"step": [[name, value], ...]},                  # per parameter, replicated
                "param_groups": {"0": {"lr": ..., "betas": ..., ...}, ...}},   # hyper-parameters, no "params"
     "layout": {"format": 1, "stage": s, "world_size": n, "precision": "bfloat16", "optimizer": "AdamW",
                "numel": ..., "shapes": [[name, [dims]], ...], "aliases": [[tied_name, name], ...]}}

Optimizer state tensors shaped like a master shard become chunks; the other values (Adam's 0-dim ``step``) are
stored for every parameter of the bucket (replicated: all ranks agree; lists of plain values are one DCP item each);
a bucket of a new layout takes them from its first parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elasticzero.engine.zero.comm.work import follows
from elasticzero.engine.zero.layout import FlatChunk, ZeroLayout
from elasticzero.errors import UsageError

FORMAT = 1


@dataclass(frozen=True)
class Origin:
    """The run a state comes from, as the checkpoint records it (``elasticzero-checkpoint inspect`` shows it)."""

    stage: int
    world_size: int
    precision: str  # "float32", "bfloat16", ...: the dtype of the parameters in the forward
    optimizer: str  # the wrapped optimizer's class name (an import: where it came from)


@dataclass(frozen=True)
class ShardedState:
    """One rank's share of a ZeRO optimizer's model and optimizer state, per parameter, over ``layout``.

    ``params`` and ``optim_state`` are :class:`FlatChunk` s of the pieces this rank owns (views of the tensors they
    were built over); ``scalars`` the per-parameter optimizer values that are not element-wise (``{key: {name:
    value}}``); ``param_groups`` the wrapped optimizer's hyper-parameters (no ``params``); ``module`` the frozen
    parameters and buffers (every rank the same); ``aliases`` the tied names of trainable parameters
    (``{alias: name}``)."""

    layout: ZeroLayout
    origin: Origin
    aliases: dict[str, str]
    params: dict[str, FlatChunk]
    optim_state: dict[str, dict[str, FlatChunk]]
    scalars: dict[str, dict[str, Any]]
    param_groups: tuple[dict[str, Any], ...]
    module: dict[str, torch.Tensor]

    @classmethod
    def of(
        cls,
        layout: ZeroLayout,
        rank: int,
        masters: Sequence[torch.Tensor],
        states: Sequence[Mapping[str, Any]],
        *,
        origin: Origin,
        aliases: Mapping[str, str],
        param_groups: Sequence[Mapping[str, Any]],
        module: Mapping[str, torch.Tensor],
    ) -> ShardedState:
        """The state over ``masters`` and ``states`` (one flat tensor and one optimizer-state dict per bucket of
        ``layout``, laid out as ``rank``'s shard of it): chunks are views, nothing is copied."""
        params: dict[str, FlatChunk] = {}
        optim_state: dict[str, dict[str, FlatChunk]] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for b, m, inner in zip(layout.buckets, masters, states, strict=True):
            check_reshardable(inner, m)
            flat = {k: b.chunks(rank, v) for k, v in inner.items() if is_shard_state(v, m)}
            for k, v in inner.items():
                if k not in flat:
                    value = v.item() if torch.is_tensor(v) else v
                    scalars.setdefault(k, {}).update(dict.fromkeys(b.names, value))
            params.update(b.chunks(rank, m))
            for p in b.pieces(rank):
                optim_state[p.name] = {k: chunks[p.name] for k, chunks in flat.items()}
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in param_groups)
        return cls(layout, origin, dict(aliases), params, optim_state, scalars, groups, dict(module))

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any], layout: ZeroLayout) -> ShardedState:
        """The tree :meth:`state_dict` made, read back into ``layout`` (its chunks are ``layout``'s pieces: what a
        load filled), after checking that the record fits ``layout`` (:func:`check_record`)."""
        record, optim = sd["layout"], sd["optim"]
        check_record(record, layout)
        origin = Origin(record["stage"], record["world_size"], record["precision"], record["optimizer"])
        scalars = {k: dict(pairs) for k, pairs in optim["scalars"].items()}
        aliases = dict(record.get("aliases") or [])
        groups = tuple(optim["param_groups"].values())
        return cls(layout, origin, aliases, sd["params"], optim["state"], scalars, groups, sd["module"])

    def detached(self, *, masters: bool = True, memo: dict[Hashable, torch.Tensor] | None = None) -> ShardedState:
        """This state with the masters' chunks and the module's tensors copied, the optimizer state's chunks still
        views: what outlives the wrap of a module whose optimizer handed it back without a copy
        (:meth:`ZeroOptimizer.unwrap <.base.ZeroOptimizer.unwrap>`, ``copy=False``) — that wrap writes the buffer
        the masters view and the module's tensors, never the released optimizer's state. Costs a copy of the
        master shard (one rank's share of the parameters) and of the module's frozen parameters and buffers.

        ``masters=False``: the module's tensors only (a buddy copy's state: its masters are host copies of their own,
        its module entries the live module's). ``memo``: the copies made so far, by the memory copied — shared by the
        states that name the same module tensors (one copy each)."""
        memo = {} if memo is None else memo
        module = {k: _copied(v, memo) for k, v in self.module.items()}
        if not masters:
            return dataclasses.replace(self, module=module)
        return dataclasses.replace(self, params=_copied_together(self.params), module=module)

    def state_dict(self) -> dict[str, Any]:
        """The tree a checkpoint stores (see the module's docstring)."""
        scalars = {k: [[n, v] for n, v in by_name.items()] for k, by_name in self.scalars.items()}
        groups = {str(i): g for i, g in enumerate(self.param_groups)}
        return {
            "params": self.params,
            "module": self.module,
            "optim": {"state": self.optim_state, "scalars": scalars, "param_groups": groups},
            "layout": layout_record(self.layout, self.origin, self.aliases),
        }


def _copied_together(chunks: Mapping[str, FlatChunk]) -> dict[str, FlatChunk]:
    """``chunks`` over copies of their tensors: chunks that lie back to back in one storage (a bucket shard's pieces)
    over one copy of that span, at the same distances (one buffer, as before, and one allocation)."""
    order = sorted(chunks, key=lambda n: (_storage(chunks[n].tensor), chunks[n].tensor.storage_offset()))
    runs: list[list[str]] = []
    for n in order:
        if runs and follows(chunks[runs[-1][-1]].tensor, chunks[n].tensor):
            runs[-1].append(n)
        else:
            runs.append([n])
    out = {}
    for run in runs:
        first = chunks[run[0]].tensor
        lo, total = first.storage_offset(), sum(chunks[n].tensor.numel() for n in run)
        copy = first.as_strided((total,), (1,), lo).clone() if first.stride() == (1,) else first.clone()
        for n in run:
            at = chunks[n].tensor.storage_offset() - lo
            out[n] = chunks[n].with_tensor(copy[at : at + chunks[n].tensor.numel()])
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _copied(t: torch.Tensor, memo: dict[Hashable, torch.Tensor]) -> torch.Tensor:
    """A copy of ``t``, made once per memory viewed (``memo``: views of the same elements share it)."""
    key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
    if key not in memo:
        memo[key] = t.clone()
    return memo[key]


def layout_record(layout: ZeroLayout, origin: Origin, aliases: Mapping[str, str]) -> dict[str, Any]:
    """What a checkpoint records about a ZeRO state (the ``"layout"`` entry): format, origin, shapes, tied names."""
    return {
        "format": FORMAT,
        "stage": origin.stage,
        "world_size": origin.world_size,
        "precision": origin.precision,
        "optimizer": origin.optimizer,
        "numel": layout.numel,
        "shapes": [[n, list(s.shape)] for n, s in layout.params.items()],
        "aliases": [[alias, name] for alias, name in aliases.items()],
    }


def check_record(saved: Mapping[str, Any], layout: ZeroLayout) -> None:
    """:class:`UsageError` unless a state recorded as ``saved`` (a ``"layout"`` entry) is of ``layout``'s model: a
    format this version reads, the same parameter names and shapes."""
    if saved.get("format") != FORMAT:
        raise UsageError(f"ZeRO state format {saved.get('format')!r} is not supported (this version reads {FORMAT})")
    mine = {n: list(s.shape) for n, s in layout.params.items()}
    theirs = dict(saved["shapes"])
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if missing or extra:
        raise UsageError(
            f"checkpoint is of another model: parameters only here {missing[:3]}, only in the checkpoint {extra[:3]}"
        )
    for name, shape in mine.items():
        if list(theirs[name]) != shape:
            raise UsageError(f"checkpoint is of another model: {name} has shape {theirs[name]} there, {shape} here")


def is_shard_state(v: Any, master: torch.Tensor) -> bool:
    """Whether optimizer state value ``v`` is element-wise over ``master`` (a tensor shaped like the flat shard)."""
    return torch.is_tensor(v) and v.shape == master.shape and v.dim() == 1


def check_reshardable(inner: Mapping[str, Any], master: torch.Tensor) -> None:
    """:class:`UsageError` for optimizer state that is neither 0-dim nor shaped like ``master`` (it has no
    per-element meaning a reshard could keep)."""
    for k, v in inner.items():
        if torch.is_tensor(v) and v.dim() != 0 and not is_shard_state(v, master):
            raise UsageError(
                f"optimizer state {k!r} has shape {tuple(v.shape)}: only 0-dim tensors and tensors shaped like the "
                f"master shard {tuple(master.shape)} can be resharded"
            )
