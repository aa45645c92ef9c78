"""Build the engine pieces from a config, for DeepSpeed migrants. It returns the pieces; the loop stays yours::

    pieces = build_pieces(model, "ds_config.json")
    net, opt, timers, acc = pieces.wrap(model), pieces.optimizer, pieces.timers, pieces.accumulation
    for x, y in loader:
        with acc.no_sync(net, opt):           # backward inside: the gradient hooks read the sync flag
            with timers.phase("forward"), pieces.autocast():
                loss = acc.scale_loss(loss_fn(net(x), y))
            with timers.phase("backward"):
                pieces.backward(loss)         # through the loss scaler when there is one
        if acc.advance():
            pieces.step()                     # unscale → clip → step → update the scale → zero_grad → schedule

The same loop runs every stage; ``pieces.stateful(model)`` is what a checkpoint of it holds. Stage 0 returns a plain
``torch.optim`` optimizer over ``model.parameters()`` (``pieces.wrap`` puts the model in DDP); with bf16/fp16 it sets
``autocast_dtype`` for ``torch.autocast`` (the model stays fp32, torch AMP style; ``pieces.autocast()``). Stages 1-3
return ``ZeroStageN(model, torch.optim.<type>, options=ZeroOptions(precision=..., bucket_bytes=..., prefetch=...),
**params)`` (each ``zero.*`` option only when set and taken by that stage: ``ZeroOptions.taken_by``). A
``scheduler`` section becomes ``pieces.scheduler``, a DeepSpeed schedule (:mod:`elasticzero.engine.lr_schedules`) on
``pieces.optimizer``, stepped by ``pieces.step()`` where DeepSpeed's engine steps it: after each optimizer step that
was taken (not after a skipped fp16 overflow).
"""

from __future__ import annotations

import copy
import importlib
import logging
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import LRScheduler

from elasticzero.config.auto import AutoValues
from elasticzero.config.batch import check_batch_sizes, resolve_world_size
from elasticzero.config.elastic import BatchPlan, batch_plan
from elasticzero.config.load import load_config, optimizer_class
from elasticzero.config.schema import ActivationCheckpointingConfig, EngineConfig, OffloadConfig, Precision
from elasticzero.engine.accumulation import GradAccumulation
from elasticzero.engine.activations import BlockSpec, checkpoint_activations, find_blocks
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.engine.lr_schedules import build_schedule
from elasticzero.engine.precision import PrecisionPolicy
from elasticzero.engine.step import StepResult, backward, clip_grad_norm, optimizer_step
from elasticzero.engine.timers import PhaseTimers
from elasticzero.engine.zero.offload import OffloadOptions
from elasticzero.engine.zero.options import ZeroOptions
from elasticzero.errors import UsageError

__all__ = ["EnginePieces", "build_loss_scaler", "build_pieces"]

log = logging.getLogger(__name__)


@dataclass
class EnginePieces:
    """What :func:`build_pieces` returns; every field is an ordinary object you drive from your own loop."""

    optimizer: torch.optim.Optimizer  # ZeroStageN (stages 1-3) or a plain torch.optim optimizer (stage 0)
    scaler: LossScaler | None  # None unless loss scaling is on (fp16 by default)
    timers: PhaseTimers  # disabled unless timers.enabled
    accumulation: GradAccumulation
    clip_grad_norm: float | None  # None = no clipping
    precision: PrecisionPolicy
    autocast_dtype: torch.dtype | None  # stage 0 with bf16/fp16: run the forward under torch.autocast(dtype=...)
    micro_batch_size: int
    config: EngineConfig
    checkpointed: list[str] = field(default_factory=list)  # blocks whose activations are checkpointed (by name)
    # the config's ``scheduler`` (a DeepSpeedSchedule), or a front door's own torch schedule; None without one
    scheduler: LRScheduler | None = None

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.accumulation.steps

    def clip_grad_norm_(self) -> torch.Tensor | None:
        """Clip to ``clip_grad_norm`` (after ``scaler.unscale_``): the ZeRO optimizer's global-norm clip, or
        ``torch.nn.utils.clip_grad_norm_`` for a plain optimizer. Returns the total norm, None when clipping is off."""
        return None if self.clip_grad_norm is None else clip_grad_norm(self.optimizer, self.clip_grad_norm)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the loss scaler when there is one; on the micro-batch that ends an optimizer
        step, with ZeRO-Offload's step in backward armed (where the clip and the scaler allow it)."""
        with self._arming():
            backward(loss, self.scaler)

    def _arming(self) -> AbstractContextManager[Any]:
        """``optimizer.stepping_in_backward`` on the accumulation boundary when the config asks for it, else a
        plain context."""
        arm = getattr(self.optimizer, "stepping_in_backward", None)
        wanted = self.config.zero.offload.optimizer and self.config.zero.offload.step_in_backward
        if arm is None or not wanted or not self.accumulation.is_boundary:
            return nullcontext()
        return arm(clipping=self.clip_grad_norm is not None, loss_scaling=self.scaler is not None)

    def step(self, *, max_norm: float | Literal["config"] | None = "config") -> StepResult:
        """End the optimizer step: unscale → clip → step → update the scale → zero_grad
        (:func:`~elasticzero.engine.step.optimizer_step`), then the schedule's step unless the optimizer step was
        skipped (DeepSpeed's engine does not step its scheduler on an fp16 overflow either). ``max_norm``: the
        clipping norm of this step (None: no clip; default: the config's ``clip_grad_norm``) — a front door whose
        framework decides the clip per step (Lightning's ``configure_gradient_clipping``) passes it."""
        norm = self.clip_grad_norm if isinstance(max_norm, str) else max_norm
        result = optimizer_step(self.optimizer, scaler=self.scaler, max_norm=norm)
        if self.scheduler is not None and not result.skipped:
            self.scheduler.step()
        return result

    def count_taken_step(self) -> None:
        """What :meth:`step` does after a step taken (no overflow) elsewhere — the live reshard's step counted done,
        its optimizer update already in the resharded state: the scale's clean-step update, then the schedule's
        step."""
        if self.scaler is not None:
            self.scaler.count_taken_step()
        if self.scheduler is not None:
            with warnings.catch_warnings():  # this round's optimizer has not stepped yet: torch's order warning is moot
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
                self.scheduler.step()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to train: ``DistributedDataParallel(model)`` at stage 0 (it averages the plain optimizer's
        gradients; needs ``torch.distributed`` initialised), ``model`` itself at stages 1-3 (the ZeRO stage hooks
        it)."""
        return torch.nn.parallel.DistributedDataParallel(model) if self.config.zero.stage == 0 else model

    def autocast(self) -> AbstractContextManager[Any]:
        """Where the forward runs: ``torch.autocast`` at ``autocast_dtype`` (stage 0 with bf16/fp16), else a plain
        context (the ZeRO stages keep compute copies in their precision)."""
        if self.autocast_dtype is None:
            return nullcontext()
        device = next(p for g in self.optimizer.param_groups for p in g["params"]).device
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def stateful(self, model: torch.nn.Module) -> dict[str, Any]:
        """What a checkpoint of these pieces holds, for :class:`~elasticzero.checkpoint.Checkpointer`: ``"model"``
        (model and optimizer: ``ZeroCheckpointState`` at stages 1-3, ``ReplicatedState`` at stage 0; both reshard
        to any world size), ``"scaler"`` when there is a loss scaler and ``"scheduler"`` when there is a schedule (its
        ``last_batch_iteration``: the same at every world size)."""
        if self.config.zero.stage == 0:
            from elasticzero.checkpoint.replicated import ReplicatedState

            state: dict[str, Any] = {"model": ReplicatedState(model, self.optimizer)}
        else:
            from elasticzero.engine.zero import ZeroCheckpointState

            state = {"model": ZeroCheckpointState(self.optimizer)}
        return {**state, **self.carried()}

    def carried(self) -> dict[str, Any]:
        """The world-independent part of :meth:`stateful`: ``"scaler"`` (its scale and counters) when there is a loss
        scaler, ``"scheduler"`` (its ``last_batch_iteration``) when there is a schedule. A live round change carries
        them from a member that held them (:mod:`elasticzero.live.loop`); the model and optimizer are resharded."""
        state: dict[str, Any] = {}
        if self.scaler is not None:
            state["scaler"] = self.scaler
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        return state


def build_loss_scaler(cfg: EngineConfig, process_group: Any = None) -> LossScaler | None:
    """A :class:`LossScaler` from ``cfg.precision.loss_scale`` or None when scaling is off (default: on for fp16)."""
    ls = cfg.precision.loss_scale
    enabled = ls.enabled if ls.enabled is not None else cfg.precision.dtype is Precision.fp16
    if not enabled:
        return None
    return LossScaler(
        ls.init_scale,
        dynamic=ls.dynamic,
        growth_factor=ls.growth_factor,
        backoff_factor=ls.backoff_factor,
        growth_interval=ls.growth_interval,
        hysteresis=ls.hysteresis,
        consecutive_hysteresis=ls.consecutive_hysteresis,
        min_scale=ls.min_scale,
        process_group=process_group,
    )


def build_pieces(
    model: torch.nn.Module,
    cfg: EngineConfig | str | Path | Mapping[str, Any],
    *,
    process_group: Any = None,
    overrides: Sequence[str] = (),
    strict: bool = True,
    auto: AutoValues | None = None,
    param_groups: Sequence[dict[str, Any]] | None = None,
    sync_module_states: bool = True,
) -> EnginePieces:
    """Build optimizer, loss scaler, timers and accumulation helper for ``model`` from ``cfg``.

    ``cfg``: an :class:`EngineConfig`, or a file/dict for :func:`~elasticzero.config.load.load_config` (native or
    DeepSpeed; ``overrides``, ``strict`` and ``auto`` — a DeepSpeed config's ``"auto"`` values,
    :class:`~elasticzero.config.auto.AutoValues` — are passed on). ``param_groups``: torch-style groups
    (``{"params": [...], **options}``, every trainable parameter in one) over the config's ``optimizer.params``, e.g.
    the HF ``Trainer``'s weight decay off for biases and norms; default one group. ``sync_module_states``: stages
    1-3 broadcast the module's parameters and buffers from group rank 0 at construction (the same start on every
    rank); False where the caller writes the module's state right after (a live round whose members hold state: its
    reshard does, :class:`~elasticzero.live.LiveTraining`). Stages 1-3 need ``torch.distributed`` initialised; the
    batch sizes are checked against the real world size.
    """
    if not isinstance(cfg, EngineConfig):
        if auto is not None and auto.world_size is None:
            auto = replace(auto, world_size=_world_size(process_group))
        cfg = load_config(cfg, overrides=overrides, strict=strict, auto=auto)
    world = _world_size(process_group)
    if world is not None:  # the plan for this world (an elastic config may predate it), checked against it
        cfg = _with_plan(cfg, batch_plan(cfg, world))
    check_batch_sizes(cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps, world, "config")
    policy = PrecisionPolicy.from_name(cfg.precision.dtype.value, cfg.precision.reduce_in_low_precision)
    timers = PhaseTimers(enabled=cfg.timers.enabled, synchronize=cfg.timers.synchronize)
    opt_cls = optimizer_class(cfg.optimizer.type)
    params = dict(cfg.optimizer.params)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    blocks = _checkpoint_blocks(model, cfg.activation_checkpointing)  # checked before anything is built

    autocast_dtype = None
    if cfg.zero.stage == 0:
        optimizer = opt_cls(model.parameters() if param_groups is None else param_groups, **params)
        if cfg.precision.dtype is not Precision.fp32:
            autocast_dtype = policy.param_dtype
        for key in _ZERO_OPTIONS:
            if getattr(cfg.zero, key) is not None:
                log.warning("zero.%s has no effect at stage 0 (DDP has its own bucket_cap_mb)", key)
    else:
        stage_cls = getattr(importlib.import_module("elasticzero.engine.zero"), f"ZeroStage{cfg.zero.stage}")
        options = _zero_options(cfg, process_group, policy, timers, sync_module_states)
        optimizer = stage_cls(model, opt_cls, options=options, param_groups=param_groups, **params)

    group = getattr(optimizer, "process_group", None) or process_group
    sched = cfg.scheduler
    scheduler = None if sched.type is None else build_schedule(optimizer, sched.type, sched.params)
    checkpointed = [] if blocks is None else checkpoint_activations(model, blocks, cpu=cfg.activation_checkpointing.cpu)
    return EnginePieces(
        optimizer=optimizer,
        scaler=build_loss_scaler(cfg, group),
        timers=timers,
        accumulation=GradAccumulation(cfg.accumulation_steps),
        clip_grad_norm=cfg.clip_grad_norm if cfg.clip_grad_norm > 0 else None,
        precision=policy,
        autocast_dtype=autocast_dtype,
        micro_batch_size=cfg.micro_batch_size,
        config=cfg,
        checkpointed=checkpointed,
        scheduler=scheduler,
    )


_ZERO_OPTIONS = ("bucket_bytes", "prefetch", "reshard_after_forward")


def _checkpoint_blocks(model: torch.nn.Module, ac: ActivationCheckpointingConfig) -> list[torch.nn.Module] | None:
    """The blocks ``activation_checkpointing`` asks for (None when off): those of the class ``ac.blocks`` names, else
    the model's repeated blocks; a :class:`~elasticzero.errors.UsageError` naming the key when there are none."""
    if not ac.enabled:
        return None
    name = ac.blocks
    if name is not None and not any(type(m).__name__ == name for m in model.modules()):
        raise UsageError(f"activation_checkpointing.blocks: no module of class {name!r} in {type(model).__name__}")
    spec: BlockSpec = None if name is None else (lambda m: type(m).__name__ == name)
    try:
        return [m for _, m in find_blocks(model, spec)]
    except UsageError as exc:
        raise UsageError(f"activation_checkpointing: {exc}") from None


def offload_options(cfg: OffloadConfig) -> OffloadOptions:
    """The engine's :class:`~elasticzero.engine.zero.offload.OffloadOptions` for a ``zero.offload`` block."""
    return OffloadOptions(
        optimizer=cfg.optimizer,
        params=cfg.params,
        pin_memory=cfg.pin_memory,
        ratio=cfg.ratio,
        device_budget_bytes=cfg.device_budget_bytes,
        step_in_backward=cfg.step_in_backward,
    )


def _with_plan(cfg: EngineConfig, plan: BatchPlan) -> EngineConfig:
    """``cfg`` with ``plan``'s batch sizes: ``cfg`` itself when they are its own, else a copy."""
    sizes = (plan.global_batch_size, plan.micro_batch_size, plan.accumulation_steps)
    if (cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps) == sizes:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps = sizes
    return cfg


def _zero_options(
    cfg: EngineConfig, process_group: Any, policy: PrecisionPolicy, timers: PhaseTimers, sync_module_states: bool
) -> ZeroOptions:
    """The stage's options from ``cfg``: each ``zero.*`` option set there and taken by the stage (a warning names one
    it does not take, :meth:`ZeroOptions.taken_by`), the timers when enabled, ``zero.offload`` when it is on."""
    taken = ZeroOptions.taken_by(cfg.zero.stage)
    chosen: dict[str, Any] = {}
    for key in _ZERO_OPTIONS:
        value = getattr(cfg.zero, key)
        if value is not None and key in taken:
            chosen[key] = value
        elif value is not None:
            log.warning("zero.%s is not used by ZeroStage%d", key, cfg.zero.stage)
    if cfg.zero.offload.optimizer:
        chosen["offload"] = offload_options(cfg.zero.offload)
    timed = timers if cfg.timers.enabled else None
    return ZeroOptions(
        process_group=process_group, precision=policy, timers=timed, sync_module_states=sync_module_states, **chosen
    )


def _world_size(process_group: Any) -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return resolve_world_size(None)
