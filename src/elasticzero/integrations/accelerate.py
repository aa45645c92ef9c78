"""``ZeroAccelerator``: an ``accelerate.Accelerator`` whose loop trains a ZeRO stage (docs/integrations-accelerate.md).

::

    accelerator = ZeroAccelerator(gradient_accumulation_steps=2)   # every Accelerator argument; builds the group
    model = build_model()
    opt = ZeroStage2(model, torch.optim.AdamW, lr=1e-3)              # after the Accelerator: the group exists
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()
    accelerator.save_state("ckpt")                                  # sharded DCP, every rank; loads at any world

What changes against a plain ``Accelerator`` once a ZeRO optimizer is prepared (everything else is accelerate's):

- ``prepare`` marks the optimizer's module prepared, so accelerate neither wraps it in DDP nor moves it; the optimizer
  comes back as a :class:`ZeroAcceleratedOptimizer` whose ``step`` is the engine's
  (:func:`~elasticzero.engine.step.optimizer_step`: unscale → step → scale update), ``step_was_skipped`` its
  overflow verdict (an ``AcceleratedScheduler`` then skips its step, as accelerate's own fp16 path does).
- ``backward`` divides by the accumulation steps and goes through the engine's loss scaler when there is one;
  ``accumulate``/``no_sync`` defer stage 1/2's reduce-scatter (``opt.no_sync()``; stage 3 reduces every backward).
- ``clip_grad_norm_(model.parameters(), n)`` is the engine's global-norm clip over every rank's shards.
- ``save_state``/``load_state`` write and read a :class:`~elasticzero.checkpoint.Checkpointer` checkpoint from every
  rank (model and optimizer as :class:`~elasticzero.engine.zero.ZeroCheckpointState`: any world size and stage),
  ``get_state_dict``/``save_model`` the full model gathered from the masters.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

from elasticzero.checkpoint import Checkpointer, RNGState
from elasticzero.checkpoint.commit import step_dir
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.engine.step import optimizer_step
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from elasticzero.errors import UsageError

__all__ = [
    "ZeroAcceleratedOptimizer",
    "ZeroAccelerator",
    "check_distributed",
    "check_window",
    "clip_route",
    "state_directory",
]

#: accelerate's distributed types under which the engine drives the data parallelism itself (one process per device,
#: torch.distributed initialised by accelerate); the others bring their own sharding or a device the engine lacks
PLAIN_TYPES = frozenset(
    {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU}
)


def check_distributed(distributed_type: DistributedType, mixed_precision: str, world_size: int) -> None:
    """Refuse, with the fix, an accelerate setup the engine cannot share the model with (``world_size``: the
    launcher's ``WORLD_SIZE``)."""
    if distributed_type is DistributedType.NO and world_size > 1:
        raise UsageError(
            f"ZeroAccelerator: launched as one of {world_size} ranks but accelerate set up no process group (it found "
            "no accelerator and was not told to use the CPU): pass cpu=True or set ACCELERATE_USE_CPU=1"
        )
    if distributed_type not in PLAIN_TYPES:
        raise UsageError(
            f"ZeroAccelerator: accelerate's distributed type is {distributed_type.value}; the ZeRO engine shards the "
            "model itself: launch without --use_deepspeed/--use_fsdp/--use_megatron_lm (plain --multi_gpu)"
        )
    if mixed_precision != "no":
        raise UsageError(
            f"ZeroAccelerator: mixed_precision={mixed_precision!r} is accelerate's autocast and GradScaler; the ZeRO "
            "stage keeps its own compute copies: pass precision='bf16'|'fp16' to the stage (and a LossScaler for fp16) "
            "and launch with --mixed_precision no"
        )


def clip_route(passed: Iterable[int], managed: Iterable[int]) -> str:
    """Who clips the parameters ``passed`` (object ids): ``"engine"`` when they include every parameter the ZeRO
    optimizer manages (its global norm over the shards), ``"torch"`` when they include none; some but not all is a
    :class:`UsageError` (the engine's norm is over all of its parameters or none)."""
    passed_set, managed_set = set(passed), set(managed)
    ours = passed_set & managed_set
    if not ours:
        return "torch"
    if ours == managed_set:
        return "engine"
    raise UsageError(
        f"ZeroAccelerator.clip_grad_norm_: {len(ours)} of the ZeRO optimizer's {len(managed_set)} parameters given; "
        "its clip is over all of them: pass model.parameters()"
    )


def check_window(micro_step: int, accumulation_steps: int) -> None:
    """Refuse a save inside an accumulation window (``micro_step``: accelerate's count of ``accumulate`` calls): the
    gradients accumulated so far are in no checkpoint, and the window may have another length where it resumes."""
    if micro_step % accumulation_steps:
        raise UsageError(
            f"ZeroAccelerator.save_state: micro-batch {micro_step % accumulation_steps} of an accumulation window of "
            f"{accumulation_steps}: the gradients accumulated so far are not checkpointed; save after the step "
            "(when accelerator.sync_gradients)"
        )


def state_directory(output_dir: str | Path | None, project_dir: str | Path | None, automatic: bool) -> Path:
    """Where ``save_state``/``load_state`` keep their checkpoints: ``project_dir/checkpoints`` under accelerate's
    ``automatic_checkpoint_naming`` (its own rule), else ``output_dir``, which is then required."""
    if automatic:
        if project_dir is None:
            raise UsageError("ZeroAccelerator: automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        return Path(project_dir) / "checkpoints"
    if output_dir is None:
        raise UsageError("ZeroAccelerator.save_state/load_state: pass the checkpoint directory (output_dir/input_dir)")
    return Path(output_dir)


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a ZeRO stage: ``step`` (on an accumulation boundary, as accelerate's) is
    the engine's :func:`~elasticzero.engine.step.optimizer_step` through ``loss_scaler``; ``step_was_skipped`` is
    its overflow verdict, agreed over the ranks; ``steps`` counts the boundaries stepped (skipped ones included)."""

    def __init__(self, optimizer: ZeroOptimizer, loss_scaler: LossScaler | None = None) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)  # the engine's state stays where it is
        self.loss_scaler = loss_scaler
        self.steps = 0

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise UsageError("ZeroAcceleratedOptimizer.step: closures are not supported (backward before step)")
        if not self.gradient_state.sync_gradients:
            return
        self._is_overflow = optimizer_step(self.optimizer, scaler=self.loss_scaler).skipped
        self.steps += 1


class ZeroAccelerator(Accelerator):
    """An ``Accelerator`` that trains a ZeRO stage passed to :meth:`prepare` (see the module docstring).

    Args:
        loss_scaler: the engine's :class:`~elasticzero.engine.loss_scaler.LossScaler` (fp16: ``pieces.scaler``
            from :func:`~elasticzero.config.build_pieces`); None: no loss scaling.
        keep_last: committed checkpoints ``save_state`` keeps in a directory (accelerate's ``total_limit`` when set).
        *args, **kwargs: ``accelerate.Accelerator``'s.
    """

    def __init__(self, *args: Any, loss_scaler: LossScaler | None = None, keep_last: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_distributed(self.distributed_type, str(self.mixed_precision), int(os.environ.get("WORLD_SIZE", "1")))
        self.zero: ZeroAcceleratedOptimizer | None = None
        self._loss_scaler = loss_scaler
        self.keep_last = self.project_configuration.total_limit or keep_last
        self._checkpointers: dict[tuple[Path, bool], Checkpointer] = {}
        self._model_state: ZeroCheckpointState | None = None

    # -- prepare -------------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """accelerate's ``prepare``; a ZeRO optimizer among ``args`` is wrapped as :class:`ZeroAcceleratedOptimizer`
        and its module marked prepared (no DDP, no device move: the engine owns both)."""
        args = tuple(self._adopt(a) if isinstance(a, ZeroOptimizer) else a for a in args)
        return super().prepare(*args, device_placement=device_placement)

    def _adopt(self, opt: ZeroOptimizer) -> ZeroAcceleratedOptimizer:
        if self.zero is not None and self.zero.optimizer is not opt:
            raise UsageError("ZeroAccelerator: one ZeRO optimizer per accelerator (as accelerate's DeepSpeed plugin)")
        if self.zero is None:
            self.zero = ZeroAcceleratedOptimizer(opt, self.loss_scaler)
            self._model_state = ZeroCheckpointState(opt)
        opt.module._is_accelerate_prepared = True  # type: ignore[assignment]  # accelerate: leave it as it is
        self.zero._is_accelerate_prepared = True
        return self.zero

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The engine's loss scaler (None: none); assignable, before or after :meth:`prepare`."""
        return self._loss_scaler

    @loss_scaler.setter
    def loss_scaler(self, scaler: LossScaler | None) -> None:
        self._loss_scaler = scaler
        if self.zero is not None:
            self.zero.loss_scaler = scaler

    @property
    def engine(self) -> ZeroOptimizer | None:
        """The prepared ZeRO optimizer (None before :meth:`prepare` got one)."""
        return None if self.zero is None else self.zero.optimizer

    # -- backward, accumulation, clipping ------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss / gradient_accumulation_steps``, backward through the engine's loss scaler when there is one."""
        if self.engine is None:
            return super().backward(loss, **kwargs)
        loss = loss / self.gradient_accumulation_steps
        (loss if self.loss_scaler is None else self.loss_scaler.scale(loss)).backward(**kwargs)
        return None

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """The engine's ``no_sync`` for its module (stages 1/2 defer the reduce-scatter; stage 3 cannot), accelerate's
        for any other model."""
        engine = self.engine
        if engine is None or model is not engine.module:
            with super().no_sync(model):
                yield
            return
        with engine.no_sync() if engine.supports_no_sync and self.use_distributed else contextlib.nullcontext():
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """The engine's global-norm clip when ``parameters`` are its module's (after unscaling; on an overflow agreed
        over the ranks nothing is clipped and the norm is inf), accelerate's otherwise."""
        params = list(parameters)
        engine = self.engine
        if engine is None or clip_route(map(id, params), managed_ids(engine)) == "torch":
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if self.loss_scaler is not None and self.loss_scaler.unscale_(engine):
            return torch.tensor(float("inf"))
        return engine.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Refused on the engine's parameters (their gradients live in its shards), accelerate's otherwise."""
        params = list(parameters)
        engine = self.engine
        if engine is not None and clip_route(map(id, params), managed_ids(engine)) == "engine":
            raise UsageError("ZeroAccelerator.clip_grad_value_: the ZeRO engine clips by norm: use clip_grad_norm_")
        super().clip_grad_value_(params, clip_value)

    # -- the full model ------------------------------------------------------------------------------------------
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The engine's module: its full state gathered from the masters (collective; the same on every rank)."""
        engine = self.engine
        if engine is not None and model is engine.module:
            return engine.full_state_dict()
        state: dict[str, torch.Tensor] = super().get_state_dict(model, unwrap=unwrap)
        return state

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """A sharded checkpoint from every rank in ``output_dir`` (``step-N``, N the optimizer steps so far;
        ``keep_last`` kept): model and optimizer, the loss scaler, the prepared schedulers, the objects registered
        for checkpointing and every rank's RNG. Collective; on an accumulation boundary only (:func:`check_window`)."""
        if self.zero is None:
            location: str = super().save_state(output_dir, safe_serialization, **kwargs)
            return location
        check_window(self.step, self.gradient_accumulation_steps)
        directory = self._directory(output_dir)
        self._checkpointer(directory, read_only=False).save(self.zero.steps, self._state())
        self.project_configuration.iteration += 1
        return str(directory / step_dir(self.zero.steps))

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Load the newest checkpoint :meth:`save_state` committed in ``input_dir``, at any world size and stage
        (the RNG only at the same world size). Collective; a bad checkpoint leaves everything untouched."""
        if self.zero is None:
            super().load_state(input_dir, load_kwargs, **kwargs)
            return
        directory = self._directory(input_dir)
        state = self._state()
        step = self._checkpointer(directory, read_only=True).load_latest(state)
        if step is None:
            raise UsageError(f"ZeroAccelerator.load_state: no committed checkpoint in {directory}")
        self.zero.steps = int(state["accelerate"]["steps"])
        self.step = 0  # saved on a window's boundary (check_window): the next micro-batch starts a window

    def _directory(self, given: str | None) -> Path:
        config = self.project_configuration
        return state_directory(given, config.project_dir, config.automatic_checkpoint_naming)

    def _checkpointer(self, directory: Path, *, read_only: bool) -> Checkpointer:
        key = (directory.resolve(), read_only)
        if key not in self._checkpointers:  # built once per directory: building one is collective (a new group)
            self._checkpointers[key] = Checkpointer(directory, keep_last=self.keep_last, read_only=read_only)
        return self._checkpointers[key]

    def _state(self) -> dict[str, Any]:
        assert self.zero is not None and self._model_state is not None
        return checkpoint_state(
            self._model_state,
            {"steps": self.zero.steps},
            self.loss_scaler,
            self._schedulers,
            self._custom_objects,
        )

    def close_checkpoints(self) -> None:
        """Finish what :meth:`save_state` started (re-raising a failed save) and let go of the checkpointers."""
        checkpointers, self._checkpointers = self._checkpointers, {}
        for ckpt in checkpointers.values():
            ckpt.close()

    def end_training(self) -> None:
        """:meth:`close_checkpoints`, then accelerate's ``end_training`` (which destroys the process group)."""
        self.close_checkpoints()
        super().end_training()


def managed_ids(engine: ZeroOptimizer) -> list[int]:
    """The ids of the module parameters the engine manages (those of its buckets)."""
    return [id(p) for bucket in engine.buckets for p in bucket.params]


def checkpoint_state(
    model: ZeroCheckpointState,
    counters: Mapping[str, int],
    scaler: LossScaler | None,
    schedulers: Iterable[AcceleratedScheduler],
    custom: Iterable[Any],
) -> dict[str, Any]:
    """What a checkpoint of a :class:`ZeroAccelerator` holds, by key: ``model`` (model and optimizer, reshardable),
    ``accelerate`` (the optimizer steps so far; updated in place on load), ``scaler``,
    ``scheduler<i>`` and ``custom<i>`` (each ``Stateful``) and ``rng``."""
    state: dict[str, Any] = {"model": model, "accelerate": dict(counters), "rng": RNGState()}
    if scaler is not None:
        state["scaler"] = scaler
    state.update({f"scheduler{i}": s for i, s in enumerate(schedulers)})
    state.update({f"custom{i}": obj for i, obj in enumerate(custom)})
    return state
