"""The Hugging Face ``Trainer``'s front door: the ZeRO engine under the ``Trainer``'s loop (docs/integrations-hf.md).

Two lines in a training script::

    from elasticzero.integrations.hf import ZeroTrainer, ZeroTrainingArguments   # instead of Trainer, TrainingArguments
    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds)               # args.zero_config: the engine config

and on the command line ``--zero_config ds_config.json`` where a DeepSpeed user wrote ``--deepspeed ds_config.json``
(the same file, its ``"auto"`` values filled from the ``TrainingArguments`` as the ``Trainer`` fills them for
DeepSpeed), launched by ``elasticzero-run``. A native elasticzero YAML works too: what it leaves out (batch sizes,
learning rate, Adam's betas/eps, weight decay, clipping, bf16/fp16) comes from the arguments, what it states must
agree with them (:func:`~elasticzero.config.auto.fill_native`).

What the door changes in the ``Trainer`` (and nothing else):

- the optimizer and schedule are built from the config (:func:`~elasticzero.config.build.build_pieces`) when the
  ``Trainer`` asks for them: ``ZeroStage1/2/3`` over the model, the config's ``scheduler`` or, without one, the
  ``Trainer``'s own ``lr_scheduler_type`` on the ZeRO optimizer; the model is marked prepared (accelerate's
  ``_is_accelerate_prepared``, as it marks what it wrapped), so it is never wrapped in DDP;
- each micro-batch's backward goes through the engine's loss scaler (``no_sync`` on stages 1/2 until the last
  micro-batch), and after the last one the engine steps: unscale → global-norm clip → step → scale update →
  ``zero_grad`` → schedule (:meth:`EnginePieces.step`, not after an fp16 overflow) — HF's DeepSpeed path steps at the
  same place. The ``Trainer``'s own ``optimizer.step()``/``lr_scheduler.step()`` are then no-ops, its clip returns
  the engine's norm;
- checkpoints: every rank writes the sharded state (model, optimizer, loss scale, schedule) through
  :class:`~elasticzero.checkpoint.Checkpointer` into ``checkpoint-N/elasticzero/``; ``resume_from_checkpoint``
  reads it back at any world size and ZeRO stage (the checkpointer reshards);
- ``save_model`` writes the full fp32 model (stage 3 gathered) that ``from_pretrained`` loads
  (:func:`elasticzero.engine.hf.save_pretrained`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from elasticzero.checkpoint.commit import latest_step, list_dir
from elasticzero.config.auto import AutoValues, fill_native
from elasticzero.config.build import EnginePieces, build_pieces
from elasticzero.config.deepspeed import looks_like_deepspeed
from elasticzero.config.load import config_from_dict, load_config, read_file
from elasticzero.config.schema import EngineConfig
from elasticzero.engine import hf as engine_hf
from elasticzero.engine.step import StepResult, backward
from elasticzero.errors import UsageError

__all__ = [
    "CHECKPOINT_SUBDIR",
    "EngineOptimizer",
    "EngineSchedule",
    "ZeroTrainer",
    "ZeroTrainingArguments",
    "auto_values",
    "decay_groups",
    "engine_config",
    "last_checkpoint",
    "zero_source",
]

CHECKPOINT_SUBDIR = "elasticzero"
"""Where in the ``Trainer``'s ``checkpoint-N`` folder the sharded checkpoint is committed (``step-N`` below it)."""

TRAINER_STATE = "trainer_state.json"
"""What the ``Trainer`` writes last into ``checkpoint-N`` (rank 0, after every rank's shards committed)."""

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]


@dataclasses.dataclass
class ZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus ``zero_config`` (``--zero_config FILE`` on an ``HfArgumentParser`` command line)."""

    zero_config: str | None = dataclasses.field(
        default=None,
        metadata={"help": "The ZeRO engine's config: a native elasticzero YAML or a DeepSpeed ds_config.json."},
    )

    def __post_init__(self) -> None:
        if self.deepspeed:  # refused before TrainingArguments sets DeepSpeed up (it would import deepspeed)
            raise UsageError(
                f"--deepspeed {self.deepspeed}: runs DeepSpeed's engine; for elasticzero's pass the same file as "
                f"--zero_config {self.deepspeed}"
            )
        super().__post_init__()


# ---- pure decisions -------------------------------------------------------------------------------------------


def zero_source(zero_config: ConfigSource | None, args: Any) -> ConfigSource:
    """The engine config of a run: ``zero_config=`` or ``args.zero_config`` (one of them, or both the same)."""
    stated = getattr(args, "zero_config", None)
    if zero_config is not None and stated is not None and zero_config != stated:
        raise UsageError(f"ZeroTrainer: zero_config={zero_config!r} and --zero_config {stated} differ; give one")
    source = zero_config if zero_config is not None else stated
    if source is None:
        raise UsageError(
            "ZeroTrainer needs the engine's config: zero_config= (a native YAML, a DeepSpeed ds_config.json or a "
            "dict), or --zero_config FILE with ZeroTrainingArguments"
        )
    return source


def check_arguments(args: Any, optimizers: tuple[Any, ...]) -> None:
    """Refuse what the door cannot honour, one line each: another engine, an optimizer/schedule (or its class)
    passed in, the batch size searched by rebuilding."""
    if getattr(args, "deepspeed", None):
        raise UsageError(f"ZeroTrainer: --deepspeed {args.deepspeed} runs DeepSpeed; pass it as --zero_config instead")
    if getattr(args, "fsdp", None):
        raise UsageError("ZeroTrainer: --fsdp shards with FSDP; the ZeRO stage comes from the config, drop --fsdp")
    if any(o is not None for o in optimizers):
        raise UsageError(
            "ZeroTrainer: optimizers=(...) or optimizer_cls_and_kwargs= is built from the config (its optimizer and "
            "scheduler sections); drop it"
        )
    if getattr(args, "auto_find_batch_size", False):
        raise UsageError(
            "ZeroTrainer: --auto_find_batch_size rebuilds the model after an out-of-memory error; the engine is built "
            "once: set --per_device_train_batch_size"
        )


def hidden_size(model_config: Any) -> int | None:
    """The model's hidden size as the ``Trainer`` reads it for the ``"auto"`` bucket sizes (None: not known)."""
    size = getattr(model_config, "hidden_size", None)
    if isinstance(size, int):
        return size
    sizes = getattr(model_config, "hidden_sizes", None)
    return max(sizes) if sizes else None


def auto_values(args: Any, *, world_size: int, max_steps: int, hidden: int | None = None) -> AutoValues:
    """What ``args`` (``TrainingArguments``) say of the engine, the ``Trainer``'s rule for a DeepSpeed config's
    ``"auto"`` (its ``trainer_config_process`` / ``trainer_config_finalize``)."""
    return AutoValues(
        world_size=world_size,
        micro_batch_size=args.per_device_train_batch_size,
        accumulation_steps=args.gradient_accumulation_steps,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        clip_grad_norm=args.max_grad_norm,
        fp16=bool(args.fp16),
        bf16=bool(args.bf16),
        warmup_steps=args.get_warmup_steps(max_steps),
        total_steps=max_steps,
        hidden_size=hidden,
    )


def checkpoint_number(name: str) -> int | None:
    """N of a ``checkpoint-N`` folder name (the ``Trainer``'s ``PREFIX_CHECKPOINT_DIR``), None for another name."""
    prefix, _, number = name.partition("-")
    return int(number) if prefix == "checkpoint" and number.isdigit() else None


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` a restart can resume from — its sharded checkpoint committed
    and the ``Trainer``'s state written after it, so a save cut short by a lost node is passed over — or None.
    Reads files only (no collective): every rank of a restarted job finds the same one."""
    root = Path(output_dir)
    found = [(n, p) for p in root.iterdir() if (n := checkpoint_number(p.name)) is not None] if root.is_dir() else []
    for _, path in sorted(found, reverse=True):
        if (path / TRAINER_STATE).is_file() and latest_step(list_dir(path / CHECKPOINT_SUBDIR)) is not None:
            return str(path)
    return None


def decay_groups(model: torch.nn.Module, decay_names: Any) -> list[dict[str, Any]]:
    """The ``Trainer``'s two parameter groups: the config's weight decay on ``decay_names``, none on the rest
    (biases, norms); empty groups left out."""
    decay = set(decay_names)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in trainable if n in decay]},
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def engine_config(source: ConfigSource, values: AutoValues) -> EngineConfig:
    """The engine config from ``source`` with ``values`` filled in: a DeepSpeed config's ``"auto"``
    (:func:`~elasticzero.config.auto.fill_auto`), a native one's unstated keys
    (:func:`~elasticzero.config.auto.fill_native`). Stage 0 (plain DDP) is refused: that is the plain ``Trainer``."""
    where: Path | dict[str, Any]
    if isinstance(source, Mapping):
        data, name, where = dict(source), "<dict>", dict(source)
    else:
        data, name, where = read_file(Path(source)), str(source), Path(source)
    if looks_like_deepspeed(data):
        cfg = load_config(where, auto=values)
    else:
        cfg = config_from_dict(fill_native(data, values, source=name), source=name)
    if cfg.zero.stage == 0:
        raise UsageError(f"{name}: ZeRO stage 0 is plain data parallelism; use transformers.Trainer, or stage 1-3")
    return cfg


# ---- what the Trainer holds ----------------------------------------------------------------------------------


class EngineOptimizer(torch.optim.Optimizer):
    """The ``Trainer``'s ``optimizer``: the ZeRO optimizer, which the engine steps after the last micro-batch's
    backward (:class:`ZeroTrainer`); the ``Trainer``'s own ``step()`` is then a no-op (HF's DeepSpeed path wraps its
    engine's optimizer alike). Marked prepared, so accelerate leaves it as it is and reads ``step_was_skipped``."""

    _is_accelerate_prepared = True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__: a view of ``optimizer``
        self.optimizer = optimizer
        self.last: StepResult | None = None  # the engine's last step (its norm, whether an overflow skipped it)
        self.last_lr: float | None = None  # the learning rate that step used (the schedule has moved on since)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine's last step was skipped (an fp16 overflow); accelerate's optimizer protocol."""
        return self.last is not None and self.last.skipped

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: the engine stepped at the end of the last micro-batch's backward."""
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


class EngineSchedule:
    """The ``Trainer``'s ``lr_scheduler``: the schedule the engine steps after each step taken; the ``Trainer``'s
    own ``step()`` is a no-op, the rest reads the schedule."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine stepped the schedule (not after an fp16 overflow)."""
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.schedule.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        return dict(self.schedule.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state_dict)


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` on the ZeRO engine (the module docstring; docs/integrations-hf.md).

    ``zero_config``: the engine's config (a native YAML, a DeepSpeed ``ds_config.json`` or a dict; default
    ``args.zero_config``). Everything else is the ``Trainer``'s; ``optimizers=`` is refused (the config builds them).
    """

    def __init__(self, *args: Any, zero_config: ConfigSource | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_arguments(self.args, (self.optimizer, self.lr_scheduler, self.optimizer_cls_and_kwargs))
        self.zero_source = zero_source(zero_config, self.args)
        self.engine: EnginePieces | None = None  # built when the Trainer asks for its optimizer
        self._checkpoint_group: Any = None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The ``Trainer``'s ``train``; ``resume_from_checkpoint=True`` is :func:`last_checkpoint` of the output
        directory (a save cut short passed over), and a :class:`UsageError` when there is none."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_checkpoint(str(self.args.output_dir))
            if resume_from_checkpoint is None:
                raise UsageError(f"{self.args.output_dir}: no complete checkpoint-N to resume from")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # -- construction: the accelerator leaves precision to the engine, the optimizer and schedule come from it --

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """Accelerate without mixed precision: the engine computes in the config's precision (fp32 masters,
        compute copies, its own loss scaler); accelerate's autocast/GradScaler would stack a second policy on it."""
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The ZeRO stage from the config over ``self.model`` (once); the model marked prepared (no DDP)."""
        if self.engine is None:
            self.engine = self._build_engine()
            self.optimizer = EngineOptimizer(self.engine.optimizer)
        assert self.optimizer is not None
        return self.optimizer

    def _build_engine(self) -> EnginePieces:
        if not dist.is_initialized():
            raise UsageError("ZeroTrainer needs torch.distributed: launch the script with elasticzero-run")
        values = auto_values(
            self.args,
            world_size=dist.get_world_size(),
            max_steps=self.state.max_steps,
            hidden=hidden_size(getattr(self.model, "config", None)),
        )
        cfg = engine_config(self.zero_source, values)
        model = self._module()
        pieces = build_pieces(model, cfg, param_groups=decay_groups(model, self.get_decay_parameter_names(model)))
        setattr(model, "_is_accelerate_prepared", True)  # noqa: B010 accelerate's own mark: prepare() adds no DDP
        self._checkpoint_group = dist.new_group(backend="gloo")  # the checkpointer's collectives (all ranks)
        return pieces

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The config's schedule, or else the ``Trainer``'s ``lr_scheduler_type`` on the ZeRO optimizer; the engine
        steps it, the ``Trainer`` holds an :class:`EngineSchedule` of it."""
        if self.lr_scheduler is None:
            engine = self._engine()
            if engine.scheduler is None:
                schedule = super().create_scheduler(num_training_steps, optimizer=engine.optimizer)
                self.engine = dataclasses.replace(engine, scheduler=schedule)
            self.lr_scheduler = cast(Any, EngineSchedule(self._engine().scheduler))
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _module(self) -> torch.nn.Module:
        if self.model is None:
            raise UsageError("ZeroTrainer needs model= (or model_init=)")
        return self.model

    def _engine(self) -> EnginePieces:
        if self.engine is None:
            raise UsageError("ZeroTrainer: the engine is built by train() (create_optimizer); call train() first")
        return self.engine

    # -- one micro-batch: the forward is the Trainer's, backward and step the engine's --

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward and loss as the ``Trainer`` computes them (``compute_loss``, its accumulation scaling), backward
        through the engine's loss scaler (stages 1/2: ``no_sync`` until the last micro-batch), and after the last
        micro-batch of a step the engine's step."""
        engine = self._engine()
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = cast(torch.Tensor, self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch))
        del inputs
        if not self._loss_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        last = bool(self.accelerator.sync_gradients)
        with _deferred(engine.optimizer, last):
            backward(loss, engine.scaler)
        if last:
            assert isinstance(self.optimizer, EngineOptimizer)
            self.optimizer.last_lr = float(engine.optimizer.param_groups[0]["lr"])
            self.optimizer.last = engine.step()
        return loss.detach()

    def _loss_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """The ``Trainer``'s rule: the loss is already a mean over the whole step's items when the model (or
        ``compute_loss_func``) normalised it by ``num_items_in_batch``."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        by_items = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        return bool(by_items or self.compute_loss_func is not None)

    def _get_learning_rate(self) -> float:
        """The learning rate of the step just taken (the ``Trainer`` logs it before stepping its schedule; the
        engine's schedule stepped with the optimizer)."""
        if isinstance(self.optimizer, EngineOptimizer) and self.optimizer.last_lr is not None:
            return self.optimizer.last_lr
        return float(super()._get_learning_rate())

    def _clip_grad_norm(self, model: Any) -> Any:
        """The engine clipped in its step (global norm over every rank's shards); its norm before clipping."""
        return self._last_norm()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        norm = self._last_norm() if grad_norm is None else grad_norm
        return norm.item() if isinstance(norm, torch.Tensor) else norm

    def _last_norm(self) -> torch.Tensor | None:
        last = self.optimizer.last if isinstance(self.optimizer, EngineOptimizer) else None
        return None if last is None else last.grad_norm

    # -- checkpoints: every rank, through the Checkpointer, inside checkpoint-N --

    def _checkpoint_state(self) -> dict[str, Any]:
        return self._engine().stateful(self._module())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its shards (model, optimizer, loss scale, schedule) as ``checkpoint-N/elasticzero``."""
        with _checkpointer(output_dir, self._checkpoint_group, read_only=False) as ckpt:
            ckpt.save(self.state.global_step, self._checkpoint_state())

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the loss scale is in the sharded checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Only a check that ``resume_from_checkpoint`` holds a sharded checkpoint (before anything changes): the
        weights come with the optimizer in :meth:`_load_optimizer_and_scheduler`, once the engine is built."""
        _sharded_dir(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The sharded checkpoint into the engine at this run's world size and stage (the checkpointer reshards)."""
        if checkpoint is None:
            return
        _sharded_dir(checkpoint)
        with _checkpointer(checkpoint, self._checkpoint_group, read_only=True) as ckpt:
            if ckpt.load_latest(self._checkpoint_state()) is None:
                raise UsageError(f"{checkpoint}: {CHECKPOINT_SUBDIR}/ holds no committed step to resume from")

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: the loss scale came with the sharded checkpoint."""

    # -- the model for from_pretrained --

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full fp32 model (stage 3 gathered: collective, every rank calls it) that ``from_pretrained`` loads;
        the processing class and the arguments beside it, as the ``Trainer`` writes them."""
        if self.engine is None:  # nothing trained under the engine yet: the Trainer's own save
            super().save_model(output_dir, _internal_call)
            return
        directory = str(output_dir if output_dir is not None else self.args.output_dir)
        engine_hf.save_pretrained(self.model, self.engine.optimizer, directory, is_main_process=self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(directory)
            torch.save(self.args, os.path.join(directory, "training_args.bin"))


def _sharded_dir(checkpoint: str) -> Path:
    """``checkpoint``'s sharded checkpoint folder, or one line saying it is not a ZeroTrainer checkpoint."""
    path = Path(checkpoint, CHECKPOINT_SUBDIR)
    if not path.is_dir():
        raise UsageError(
            f"{checkpoint}: no {CHECKPOINT_SUBDIR}/ folder, not a ZeroTrainer checkpoint (to start from its weights "
            "load them with from_pretrained and train without resume_from_checkpoint)"
        )
    return path


@contextlib.contextmanager
def _checkpointer(checkpoint: str, group: Any, *, read_only: bool) -> Iterator[Any]:
    from elasticzero.checkpoint import Checkpointer

    ckpt = Checkpointer(Path(checkpoint, CHECKPOINT_SUBDIR), keep_last=1, process_group=group, read_only=read_only)
    try:
        yield ckpt
    finally:
        ckpt.close()


def _deferred(optimizer: Any, last: bool) -> contextlib.AbstractContextManager[Any]:
    """The ZeRO stage's ``no_sync`` (stages 1/2: the gradient reduction deferred) unless this micro-batch is the
    step's last; stage 3 reduces as it goes (``supports_no_sync`` False)."""
    if last or not getattr(optimizer, "supports_no_sync", False):
        return contextlib.nullcontext()
    return cast(contextlib.AbstractContextManager[Any], optimizer.no_sync())
