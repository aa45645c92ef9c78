"""Import a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3; fp32 or bf16) as an elasticzero checkpoint, no DeepSpeed needed.

:func:`read` takes a ``save_checkpoint`` tag directory — ``mp_rank_00_model_states.pt`` (stages 1/2) or every rank's
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (stage 3), and every rank's ``zero_pp_rank_<r>_mp_rank_00_optim_
states.pt`` (``bf16_``-prefixed in bf16) — and reassembles, for each trainable parameter, the full fp32 master and
each optimizer state (Adam's moments) the way DeepSpeed's ``zero_to_fp32`` does for the masters. Stages 1/2: the
ranks' partitions of each flat group, concatenated (DeepSpeed drops the last rank's padding from the masters, not from
the moments). Stage 3: every parameter partitioned on its own, ``ceil(numel / world)`` elements per rank (the last
padded), zipped back per parameter. :func:`zero_state_dict` lays the result out as a
:class:`~elasticzero.engine.zero.sharded.ShardedState` over
:meth:`~elasticzero.engine.zero.layout.ZeroLayout.whole` (every parameter whole, one chunk each), the tree
:class:`~elasticzero.engine.zero.dcp_state.ZeroCheckpointState` saves, so :func:`import_checkpoint` commits it
through :class:`~elasticzero.checkpoint.Checkpointer` and a job loads it at any world size and stage like any other
checkpoint.

Loading never runs DeepSpeed code: ``torch.load(weights_only=True)`` with DeepSpeed's pickled class names mapped to
inert stand-ins (``ZeroStageEnum`` → ``int``; ``LossScaler`` and ``fragment_address`` keep their fields, unused). Any
other class, a missing rank file, parameter alignment padding, or sizes that do not add up are one ``UsageError``
naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch

from elasticzero.checkpoint import commit
from elasticzero.engine.zero.layout import ZeroLayout
from elasticzero.engine.zero.sharded import Origin, ShardedState
from elasticzero.errors import UsageError

_STAGE12_MODEL = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")  # mixed precision: a prefix
_MODEL3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"


class _Inert:
    """A DeepSpeed object the import does not use, rebuilt from its pickled fields without DeepSpeed's code."""

    def __setstate__(self, state: Any) -> None:
        self.fields = state


_STAND_INS: list[Any] = [
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Inert, "deepspeed.utils.tensor_fragment.fragment_address"),
]


@dataclasses.dataclass
class DeepSpeedCheckpoint:
    """What a DeepSpeed ZeRO checkpoint holds, reassembled (full tensors, no partitions)."""

    directory: Path
    stage: int
    world_size: int
    version: str
    step: int
    precision: str
    shapes: dict[str, list[int]]  # trainable parameters in DeepSpeed's flat order
    masters: dict[str, torch.Tensor]  # fp32, flat
    states: dict[str, dict[str, torch.Tensor]]  # {name: {"exp_avg": flat, ...}}
    scalars: dict[str, Any]  # per-parameter optimizer scalars (Adam's step), one value each
    param_groups: list[dict[str, Any]]
    module: dict[str, torch.Tensor]  # buffers and frozen parameters
    aliases: dict[str, str]  # tied parameter names DeepSpeed recorded ({alias: parameter})


# -- thin I/O ---------------------------------------------------------------------------------------------------------
def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed file, loaded without importing or running DeepSpeed (or anything else)."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"{path}: missing (a rank's file of the DeepSpeed checkpoint)") from None
    except Exception as exc:  # torch's UnpicklingError names the refused global
        raise UsageError(f"{path}: not a DeepSpeed checkpoint file this import reads ({_why(exc)})") from exc
    if not isinstance(obj, dict):
        raise UsageError(f"{path}: not a DeepSpeed checkpoint file (a {type(obj).__name__}, not a dict)")
    return obj


def _why(exc: Exception) -> str:
    """What a failed ``torch.load`` says is wrong (its first line is advice to unpickle freely: left out)."""
    text = str(exc).strip()
    if found := re.search(r"GLOBAL ([\w.]+)", text):
        return f"refusing to import {found[1]}"
    return text.splitlines()[0].split(". ")[0] if text else type(exc).__name__


def tag_directory(ds_dir: Path, tag: str | None) -> Path:
    """The tag directory to import: ``tag``, else the one DeepSpeed's ``latest`` file names."""
    if tag is None:
        latest = ds_dir / "latest"
        if not latest.is_file():
            raise UsageError(f"{latest}: missing; pass --tag (a directory of {ds_dir} written by save_checkpoint)")
        tag = latest.read_text().strip()
    directory = ds_dir / tag
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such DeepSpeed checkpoint tag directory")
    return directory


def read(ds_dir: Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read and reassemble the DeepSpeed ZeRO checkpoint ``ds_dir/tag`` (default: the ``latest`` tag)."""
    directory = tag_directory(ds_dir, tag)
    optim_files = sorted((int(m[1]), p) for p in directory.iterdir() if (m := _OPTIM.match(p.name)))
    if not optim_files:
        raise UsageError(f"{directory}: no zero_pp_rank_*_optim_states.pt (not a DeepSpeed ZeRO checkpoint)")
    optims = [_optimizer_part(p) for _, p in optim_files]
    stage, world = _stage_and_world(optims, optim_files)
    model_paths = [directory / _MODEL3.format(r) for r in range(world)] if stage == 3 else [directory / _STAGE12_MODEL]
    models = [load_file(p) for p in model_paths]
    return _assemble(directory, stage, world, models, optims)


def _optimizer_part(path: Path) -> dict[str, Any]:
    top = load_file(path)
    sd = top.get("optimizer_state_dict")
    if not isinstance(sd, dict) or "zero_stage" not in sd:
        raise UsageError(f"{path}: no ZeRO optimizer state in it (not a DeepSpeed ZeRO checkpoint file)")
    return {**sd, "_path": path, "_version": str(top.get("ds_version", "unknown"))}


def _stage_and_world(optims: list[dict[str, Any]], files: list[tuple[int, Path]]) -> tuple[int, int]:
    stage, count = int(optims[0]["zero_stage"]), optims[0]["partition_count"]
    world = max(count) if isinstance(count, list) else int(count)
    if stage not in (1, 2, 3):
        raise UsageError(f"{files[0][1]}: ZeRO stage {stage} (this import reads stages 1, 2 and 3)")
    ranks = [r for r, _ in files]
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise UsageError(
            f"{files[0][1].parent}: optimizer files of ranks {ranks}, {world} ranks saved (missing {missing})"
        )
    return stage, world


# -- pure: reassembly ------------------------------------------------------------------------------------------------
def _assemble(
    directory: Path, stage: int, world: int, models: list[dict[str, Any]], optims: list[dict[str, Any]]
) -> DeepSpeedCheckpoint:
    model = models[0]
    groups = [dict(g) for g in model["param_shapes"]]
    shapes = {n: list(s) for g in groups for n, s in g.items()}
    inner = [o["optimizer_state_dict" if stage == 3 else "base_optimizer_state"] for o in optims]
    where = str(directory)
    if stage == 3:

        def unflatten(parts: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
            return unflatten_stage3([torch.cat(list(p)) for p in parts], shapes, world, where)

        masters = unflatten([o["fp32_flat_groups"] for o in optims])
    else:
        _refuse_alignment_padding(optims)
        pads = [o["group_paddings"] for o in optims]  # the masters were saved without them, the states with

        def unflatten(parts: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
            return _stage12_groups(parts, groups, pads, where)

        masters = _stage12_groups([o["single_partition_of_fp32_groups"] for o in optims], groups, None, where)
    states, scalars = _states(inner, unflatten)
    module, version = _module_state(models, shapes, stage), optims[0]["_version"]
    return DeepSpeedCheckpoint(
        directory=directory,
        stage=stage,
        world_size=world,
        version=version,
        step=int(model.get("global_steps", 0)),
        precision=_precision(model, shapes),
        shapes=shapes,
        masters=masters,
        states=states,
        scalars=scalars,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in inner[0]["param_groups"]],
        module=module,
        aliases=dict(model.get("shared_params") or {}),
    )


def unflatten_stage12(partitions: list[torch.Tensor], shapes: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """Stages 1/2: the ranks' partitions of one flat group, concatenated, cut into its parameters (in order)."""
    flat = torch.cat([p.reshape(-1) for p in partitions])
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[at : at + n].clone()
        at += n
    if at > flat.numel() or flat.numel() - at >= 2 * len(partitions):  # DeepSpeed pads to 2 x world at most
        raise UsageError(f"{where}: {flat.numel()} elements in a flat group of {at} (sizes do not add up)")
    return out


def unflatten_stage3(
    partitions: list[torch.Tensor], shapes: dict[str, Any], world: int, where: str
) -> dict[str, torch.Tensor]:
    """Stage 3: every parameter split on its own into ``ceil(numel / world)`` elements per rank; ``partitions[r]`` is
    rank r's pieces of all parameters, in order."""
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        per = math.ceil(n / world)
        if any(at + per > p.numel() for p in partitions):
            raise UsageError(f"{where}: stage-3 partitions of {partitions[0].numel()} elements end inside {name!r}")
        out[name] = torch.cat([p[at : at + per] for p in partitions])[:n].clone()
        at += per
    if any(p.numel() != at for p in partitions):
        raise UsageError(f"{where}: stage-3 partitions of {partitions[0].numel()} elements, the parameters need {at}")
    return out


def _stage12_groups(
    parts: list[list[torch.Tensor]], groups: list[dict[str, Any]], pads: list[list[int]] | None, where: str
) -> dict[str, torch.Tensor]:
    """Every flat group of ``parts[rank][group]``, ``pads[rank][group]`` elements first dropped from the end of each
    rank's partition (DeepSpeed's ``group_paddings``; None: nothing to drop), cut into its parameters."""
    out: dict[str, torch.Tensor] = {}
    for i, g in enumerate(groups):
        per_rank = [p[i][: p[i].numel() - (pads[r][i] if pads else 0)] for r, p in enumerate(parts)]
        out.update(unflatten_stage12(per_rank, g, where))
    return out


def _states(inner: list[dict[str, Any]], unflatten: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({name: {key: full}}, {key: value})`` from the wrapped optimizers' state dicts of every rank; ``unflatten``
    takes one key's ``[rank][group]`` tensors (a group: a flat group of stages 1/2, a sub-group of stage 3, in the
    order of the wrapped optimizer's state indices)."""
    per_rank = [[s["state"][i] for i in sorted(s["state"])] for s in inner]
    keys = list(per_rank[0][0]) if per_rank[0] and per_rank[0][0] else []
    states: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, Any] = {}
    for key in keys:
        values = [[g[key] for g in r] for r in per_rank]
        if torch.is_tensor(values[0][0]) and values[0][0].dim() == 1:
            for name, t in unflatten(values).items():
                states.setdefault(name, {})[key] = t
        else:
            v = values[0][0]
            scalars[key] = v.item() if torch.is_tensor(v) else v
    return states, scalars


def _refuse_alignment_padding(optims: list[dict[str, Any]]) -> None:
    for o in optims:
        if any(any(p) for p in o.get("param_alignment_paddings") or []):
            raise UsageError(f"{o['_path']}: parameters padded for alignment inside the flat group (not supported)")


def _module_state(models: list[dict[str, Any]], shapes: dict[str, Any], stage: int) -> dict[str, Any]:
    """Buffers and frozen parameters. Stages 1/2: every module entry that is not a trainable parameter or a tied alias
    of one (stage 1 records no frozen shapes); stage 3: the buffers, and frozen parameters from every rank's fragments
    (its module entries of parameters are empty)."""
    model = models[0]
    module = model["module"]
    if stage != 3:
        tied = set(model.get("shared_params") or {})
        return {k: v for k, v in module.items() if k not in shapes and k not in tied}
    out = {k: module[k] for k in model.get("buffer_names") or [] if k in module}
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        parts = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        out[name] = torch.cat(parts)[: math.prod(shape)].reshape(list(shape)).clone()
    return out


def _precision(model: dict[str, Any], shapes: dict[str, Any]) -> str:
    module = model["module"]
    first = next((module[n] for n in shapes if n in module), None)
    return str(first.dtype).removeprefix("torch.") if first is not None else "float32"


# -- pure: the elasticzero layout -------------------------------------------------------------------------------------
def zero_state_dict(ck: DeepSpeedCheckpoint) -> dict[str, Any]:
    """``ck`` laid out as ``ZeroCheckpointState.state_dict()``: the :class:`ShardedState` of one process holding
    every parameter whole (:meth:`ZeroLayout.whole`), recorded as saved by DeepSpeed's stage and world size."""
    layout = ZeroLayout.whole(ck.shapes.items())
    names = list(ck.shapes)
    return ShardedState.of(
        layout,
        0,
        [ck.masters[n] for n in names],
        [{**ck.states.get(n, {}), **ck.scalars} for n in names],
        origin=Origin(ck.stage, ck.world_size, ck.precision, f"from DeepSpeed {ck.version}"),
        aliases=ck.aliases,
        param_groups=ck.param_groups,
        module=ck.module,
    ).state_dict()


class _Fixed:
    """A ``Stateful`` that only saves the state dict it was given."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover - never loaded into
        raise NotImplementedError


def import_checkpoint(ds_dir: Path, out: Path, tag: str | None = None, key: str = "zero") -> DeepSpeedCheckpoint:
    """Commit ``ds_dir``'s checkpoint as step ``global_steps`` of an elasticzero checkpoint directory ``out``, the ZeRO
    state under ``key``. Runs in this process alone (a one-rank gloo group of its own when none is initialised)."""
    import torch.distributed as dist

    from elasticzero.checkpoint.checkpointer import Checkpointer

    if commit.list_dir(out).committed:
        raise UsageError(f"{out}: already holds checkpoints; import into a new directory")
    ck = read(ds_dir, tag)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Checkpointer(out, keep_last=1) as ckpt:
            ckpt.save(ck.step, {key: _Fixed(zero_state_dict(ck))})
    finally:
        if own:
            dist.destroy_process_group()
    return ck
