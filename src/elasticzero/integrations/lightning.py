"""Lightning's front door: a ``Strategy`` that trains a ``LightningModule`` with a ZeRO stage of the engine.

::

    import elasticzero.integrations.lightning            # registers strategy="elasticzero" (and _stage_1/2/3)
    from elasticzero.integrations.lightning import ElasticZeroStrategy

    trainer = L.Trainer(strategy=ElasticZeroStrategy(config="ds_config.json"), accumulate_grad_batches=2,
                        gradient_clip_val=1.0, max_steps=1000)
    trainer.fit(module)                                   # under elasticzero-run / torchrun: RANK, WORLD_SIZE, ...

What it builds (docs/integrations-lightning.md): the default process group from the launcher's environment
(:func:`elasticzero.device.init_distributed`), the engine's pieces from a native or DeepSpeed config
(:func:`elasticzero.config.build_pieces`, its ``"auto"`` filled from the ``Trainer``) over a root module that holds
the ``LightningModule`` (never a DDP wrap: Lightning's steps are redirected through the root, so the engine's root
hooks run around them), the config's optimizer and LR schedule, a precision plugin that runs the engine's backward
(its loss scaler) and its step (unscale → clip → step → update → zero_grad → schedule; Lightning's clipping routed to
the engine's global-norm ``clip_grad_norm_``), ZeRO 1/2's ``no_sync`` while Lightning accumulates, and sharded
checkpoints: every rank writes its shards through :class:`~elasticzero.checkpoint.Checkpointer` (DCP) into the
checkpoint's folder, loadable at another world size and stage.

The decisions are pure functions (:func:`engine_precision`, :func:`clip_norm`, :func:`auto_values`,
:func:`reconcile`); the classes are the thin layer Lightning calls.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import shutil
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from elasticzero.checkpoint import Checkpointer
from elasticzero.config.auto import AutoValues, fill_native
from elasticzero.config.build import EnginePieces, build_pieces
from elasticzero.config.deepspeed import looks_like_deepspeed
from elasticzero.config.load import config_from_dict, load_config, read_file
from elasticzero.config.schema import EngineConfig
from elasticzero.config.schema import Precision as EngineDtype
from elasticzero.device import Facts, init_distributed, placement
from elasticzero.errors import UsageError
from elasticzero.fileio import write_atomic

__all__ = [
    "META_FILE",
    "ElasticZeroPrecision",
    "ElasticZeroStrategy",
    "auto_values",
    "clip_norm",
    "engine_precision",
    "load_engine_config",
    "native_values",
    "reconcile",
]

log = logging.getLogger(__name__)

#: a config: a native YAML/JSON or DeepSpeed file, or its mapping; None: ``{}`` (the native defaults)
Source = str | Path | Mapping[str, Any] | None

#: the file beside the ``step-N`` shards that holds Lightning's own part of a checkpoint (loops, callbacks, epoch)
META_FILE = "lightning.pt"

#: Lightning's ``precision=`` → the engine's compute dtype (None: the config's); any other value is refused
PRECISIONS: dict[str, str | None] = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


def engine_precision(flag: str) -> str | None:
    """The engine dtype Lightning's ``precision=`` flag asks for: None for ``"32-true"`` (the default: the config
    decides), ``"bf16"``/``"fp16"`` for the mixed flags; the ``*-true`` low precisions and the rest are refused (the
    engine keeps fp32 masters and casts compute copies, so there is no model converted to a low dtype)."""
    if flag not in PRECISIONS:
        raise UsageError(
            f"Trainer(precision={flag!r}) with strategy='elasticzero': the engine keeps fp32 masters and casts "
            "compute copies; use precision='bf16-mixed', '16-mixed' or '32-true' (the config's precision.dtype)"
        )
    return PRECISIONS[flag]


def clip_norm(config_value: float | None, trainer_value: float | None) -> float | None:
    """The one clipping norm: the ``Trainer``'s ``gradient_clip_val`` or the config's ``clip_grad_norm`` /
    ``gradient_clipping``, whichever is set (None or 0: unset); both set and different is a :class:`UsageError`."""
    config_value = config_value or None
    trainer_value = trainer_value or None
    if config_value is not None and trainer_value is not None and config_value != trainer_value:
        raise UsageError(
            f"config clip_grad_norm is {config_value} but Trainer(gradient_clip_val={trainer_value}): "
            "set one of them (or make them agree)"
        )
    return trainer_value if trainer_value is not None else config_value


def auto_values(*, world_size: int, accumulation: int, clip: float | None, dtype: str | None) -> AutoValues:
    """A DeepSpeed config's ``"auto"`` values from the ``Trainer`` (the HF Trainer's rule, the Trainer's terms):
    accumulation, clipping (0 when unset), fp16/bf16 from ``precision=`` (both false under ``"32-true"``)."""
    return AutoValues(
        world_size=world_size,
        accumulation_steps=accumulation,
        clip_grad_norm=clip if clip is not None else 0.0,
        fp16=dtype == "fp16",
        bf16=dtype == "bf16",
    )


def native_values(*, world_size: int, accumulation: int, clip: float | None, dtype: str | None) -> AutoValues:
    """What a native config leaves out, from the ``Trainer`` (:func:`~elasticzero.config.auto.fill_native`: a stated
    key must agree): the accumulation, the clipping norm when the ``Trainer`` sets one, the dtype of a mixed flag."""
    return AutoValues(
        world_size=world_size,
        accumulation_steps=accumulation,
        clip_grad_norm=clip or None,
        fp16=dtype == "fp16",
        bf16=dtype == "bf16",
    )


def load_engine_config(source: Source, overrides: Sequence[str], *, ds: AutoValues, native: AutoValues) -> EngineConfig:
    """The config of ``source`` (a path or a mapping; None: ``{}``): a DeepSpeed one with its ``"auto"`` filled from
    ``ds``, a native one with the keys it leaves out from ``native``; ``overrides`` applied last."""
    if source is None or isinstance(source, Mapping):
        data, name = dict(source or {}), "<dict>"
    else:
        data, name = read_file(Path(source)), str(source)
    if looks_like_deepspeed(data):
        return load_config(data if name == "<dict>" else Path(name), overrides=overrides, auto=ds)
    return config_from_dict(fill_native(data, native, source=name), source=name, overrides=overrides)


def reconcile(cfg: EngineConfig, *, accumulation: int, dtype: str | None, clip: float | None) -> EngineConfig:
    """``cfg`` as the strategy trains it, checked against the ``Trainer``: a ZeRO stage (1-3), Lightning's
    ``accumulate_grad_batches`` as the accumulation (a config stating another is refused), the compute dtype of
    ``precision=`` when it names one (over an fp32 config; a config stating the other low precision is refused),
    and the clipping norm of :func:`clip_norm`. Pure: returns a new config, ``cfg`` is not changed."""
    if cfg.zero.stage not in (1, 2, 3):
        raise UsageError(
            f"zero.stage is {cfg.zero.stage}: strategy='elasticzero' trains ZeRO stage 1, 2 or 3 "
            "(set zero.stage / zero_optimization.stage, or use Lightning's strategy='ddp' for stage 0)"
        )
    if cfg.accumulation_steps != accumulation:
        raise UsageError(
            f"config accumulation_steps is {cfg.accumulation_steps} but Trainer(accumulate_grad_batches="
            f'{accumulation}): Lightning\'s loop accumulates, make them agree (DeepSpeed configs: "auto")'
        )
    precision = cfg.precision
    if dtype is not None and cfg.precision.dtype.value != dtype:
        if cfg.precision.dtype is not EngineDtype.fp32:
            raise UsageError(
                f"config precision is {cfg.precision.dtype.value} but the Trainer's precision asks for {dtype}: "
                "make them agree (or leave the Trainer at precision='32-true')"
            )
        precision = dataclasses.replace(precision, dtype=EngineDtype(dtype))
    norm = clip_norm(cfg.clip_grad_norm, clip)
    return dataclasses.replace(cfg, precision=precision, clip_grad_norm=norm or 0.0)


class EngineRoot(nn.Module):
    """The module the engine wraps: the ``LightningModule`` as its one child. Lightning redirects each step
    (``training_step``, ``validation_step``, ...) through its ``forward``, so the engine's root hooks (stage 3's
    gathers and prefetch order, the bindings check, the input cast) run around the whole step, and a ``self(x)``
    inside the step is an ordinary submodule call."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ElasticZeroPrecision(Precision):
    """The engine's precision plugin: backward through the engine's loss scaler, the optimizer step as the engine
    takes it (:meth:`EnginePieces.step`), Lightning's clip routed to the engine's global-norm clip. No autocast and
    no module conversion: the ZeRO stage keeps fp32 masters and casts its compute copies (and the root's inputs)."""

    def __init__(self, precision: str = "32-true", pieces: EnginePieces | None = None) -> None:
        engine_precision(precision)  # refused here, when the Trainer is built
        self.precision = precision  # type: ignore[assignment]  # Lightning's Literal of every flag; checked above
        self.pieces = pieces
        self._max_norm: float | None = None  # what Lightning asked to clip to for the coming step

    def engine(self) -> EnginePieces:
        if self.pieces is None:
            raise UsageError("ElasticZeroPrecision: the engine is built in Trainer.fit (strategy.setup); not before")
        return self.pieces

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` through the engine's loss scaler (``EnginePieces.backward``)."""
        if args or kwargs:
            raise UsageError("strategy='elasticzero': backward takes no extra arguments (the engine runs it)")
        self.engine().backward(tensor)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Any, **kwargs: Any
    ) -> Any:
        """Run the closure (forward, backward), Lightning's hooks before the step (its clip request included), then
        the engine's step: unscale → clip → step → update the scale → zero_grad → the config's schedule."""
        result = closure()
        self._after_closure(model, optimizer)
        norm, self._max_norm = self._max_norm, None
        self.engine().step(max_norm=norm)
        return result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Record the norm for the engine's step (0: the config's); by value is refused (the gradients are shards
        the step clips by their global norm)."""
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise UsageError(
                "gradient_clip_algorithm='value' with strategy='elasticzero': the engine clips by the global norm; "
                "use gradient_clip_algorithm='norm'"
            )
        self._max_norm = float(clip_val) if clip_val > 0 else self.engine().clip_grad_norm

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self.clip_gradients(optimizer, clip_val, GradClipAlgorithmType.NORM)

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        self.clip_gradients(optimizer, clip_val, GradClipAlgorithmType.VALUE)


class ElasticZeroStrategy(ParallelStrategy):
    """Train with a ZeRO stage of the engine (module docstring; docs/integrations-lightning.md).

    Args:
        config: a native YAML/JSON or DeepSpeed config (path or dict); None: ``{}`` (AdamW at torch's defaults).
        stage: ZeRO stage 1, 2 or 3 over the config's (None: the config's; no config: 2).
        overrides: omegaconf dotlist in native key names, applied to the config last (``["zero.bucket_bytes=1e6"]``).
        timeout: the process group's collective timeout when the strategy creates it (None: the launcher's
            ``--collective-timeout``, else torch's default).
    """

    strategy_name = "elasticzero"

    def __init__(
        self,
        config: Source = None,
        *,
        stage: int | None = None,
        overrides: Sequence[str] = (),
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if stage is None and config is None:
            stage = 2
        self._config = config
        self._overrides = (*overrides, *([] if stage is None else [f"zero.stage={stage}"]))
        self._timeout = timeout
        self._pieces: EnginePieces | None = None
        self._root: EngineRoot | None = None
        self._ckpt_group: Any = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"elasticzero"`` (stage 2) and ``"elasticzero_stage_1|2|3"`` (idempotent: a second import re-registers)."""
        strategy_registry.register(cls.strategy_name, cls, description="ZeRO stage 2", override=True)
        for stage in (1, 2, 3):
            name, what = f"{cls.strategy_name}_stage_{stage}", f"ZeRO stage {stage}"
            strategy_registry.register(name, cls, description=what, override=True, stage=stage)

    # --- Lightning's precision plugin becomes the engine's -------------------------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ElasticZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning hands its plugin for ``precision=``; the strategy keeps the engine's for that flag."""
        if plugin is not None and not isinstance(plugin, ElasticZeroPrecision):
            plugin = ElasticZeroPrecision(str(getattr(plugin, "precision", "32-true")))
        self._precision_plugin = plugin

    # --- processes and devices -----------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        """``cuda:$LOCAL_RANK`` with CUDA, else the CPU (:func:`elasticzero.device.placement`), whatever
        ``devices=`` says: the launcher decides how many processes there are."""
        return torch.device(placement(Facts.current()).device)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        """The default process group from the launcher's environment (unless one exists), then Lightning's."""
        reset_seed()
        self.set_world_ranks()
        if not dist.is_initialized():
            init_distributed(timeout=self._timeout)
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        """Fitting: the model on its device, then wrapped by the engine with the config's optimizer and schedule
        (``configure_optimizers`` is not called). Otherwise the engine's root of an earlier fit of this module, or
        the plain module on its device."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            self._setup_evaluation()
            return
        self.model_to_device()
        root = EngineRoot(self.lightning_module)  # type: ignore[arg-type]
        pieces = build_pieces(root, self.engine_config(trainer))
        self._pieces, self._root = pieces, root
        self.model = root
        self.optimizers = [pieces.optimizer]
        self.lr_scheduler_configs = []
        self.precision_plugin = ElasticZeroPrecision(self.precision_plugin.precision, pieces)
        log.info("elasticzero: ZeRO stage %d; the config's optimizer and schedule", pieces.config.zero.stage)

    def _setup_evaluation(self) -> None:
        root = self._root
        if root is not None and root.module is self.lightning_module:
            self.model = root  # the engine's hooks sit on this root
        else:
            self.model_to_device()

    def engine_config(self, trainer: Any) -> EngineConfig:
        """The config loaded (a DeepSpeed one's ``"auto"`` from the ``Trainer``) and reconciled with the Trainer."""
        dtype = engine_precision(self.precision_plugin.precision)
        accumulation = int(trainer.accumulate_grad_batches)
        clip = trainer.gradient_clip_val
        auto = auto_values(world_size=self.world_size, accumulation=accumulation, clip=clip, dtype=dtype)
        native = native_values(world_size=self.world_size, accumulation=accumulation, clip=clip, dtype=dtype)
        cfg = load_engine_config(self._config, self._overrides, ds=auto, native=native)
        return reconcile(cfg, accumulation=accumulation, dtype=dtype, clip=clip)

    @property
    def pieces(self) -> EnginePieces:
        """The engine's pieces of the current fit."""
        if self._pieces is None:
            raise UsageError("ElasticZeroStrategy: the engine is built in Trainer.fit; not before")
        return self._pieces

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """While Lightning accumulates: ZeRO 1/2's ``no_sync`` (the reduction waits for the step's last
        micro-batch); stage 3 reduces as gradients are produced."""
        opt = None if self._pieces is None else self._pieces.optimizer
        if opt is None or not getattr(opt, "supports_no_sync", False):
            yield
            return
        with opt.no_sync():  # type: ignore[attr-defined]
            yield

    # --- collectives ---------------------------------------------------------------------------------------------

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def teardown(self) -> None:
        """Lightning's teardown without moving the model to the CPU (the engine's parameters stay where it put
        them: a move would be refused)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        group, self._ckpt_group = self._ckpt_group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)  # the checkpoints' group: its gloo threads joined before the process ends
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # --- checkpoints: the engine's shards from every rank ----------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine is built before its state is loaded into it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the optimizer's state is in the shards, loaded by load_checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model travels in the shards

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # so does the optimizer

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded by load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank: the engine's state (model, optimizer, loss scale, schedule) as a DCP checkpoint committed in
        the folder ``filepath`` (``step-N``, the newest kept), then rank 0 writes Lightning's part beside it."""
        if storage_options is not None:
            raise UsageError("strategy='elasticzero' saves through the engine's Checkpointer: drop storage_options")
        path = Path(self.broadcast(str(filepath)))
        step = int(checkpoint.get("global_step", 0))
        with Checkpointer(path, keep_last=1, process_group=self._checkpoint_group()) as ckpt:
            ckpt.save(step, self.pieces.stateful(self.model))  # type: ignore[arg-type]
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.is_global_zero:
            write_atomic(path / META_FILE, _pickled({**meta, "elasticzero_step": step}))
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The newest committed step of the folder into the engine (any world size and stage), and Lightning's
        part; a folder without both, of one step, is one :class:`UsageError` before anything is loaded."""
        path = Path(self.broadcast(str(checkpoint_path)))
        meta_file = path / META_FILE
        if not meta_file.is_file():
            raise UsageError(f"{path}: not a checkpoint of strategy='elasticzero' (no {META_FILE}); give its folder")
        meta = torch.load(meta_file, map_location="cpu", weights_only=weights_only)
        ckpt = Checkpointer(path, read_only=True, process_group=self._checkpoint_group())
        step = ckpt.latest_step()
        if step is None or step != meta.get("elasticzero_step"):
            found = "no committed step" if step is None else f"the shards of step {step}"
            raise UsageError(f"{path}: {META_FILE} is of step {meta.get('elasticzero_step')}, {found}")
        ckpt.load(step, self.pieces.stateful(self.model))  # type: ignore[arg-type]
        return dict(meta)

    def _checkpoint_group(self) -> Any:
        """The checkpoints' own gloo group (their collectives never mix with training's), made at the first save or
        load of a fit (collective: every rank saves and loads), destroyed by :meth:`teardown`."""
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        return self._ckpt_group

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _register() -> None:
    """Put the strategy's names in Lightning's registry (what importing this module does)."""
    ElasticZeroStrategy.register_strategies(StrategyRegistry)


_register()
