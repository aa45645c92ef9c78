"""The Lightning strategy's pure decisions (precision flag, clipping norm, "auto" values, the config reconciled with the
Trainer), its names in Lightning's registry and its precision plugin's refusals. Training is tested for real in
tests/integration/lightning/ (2 ranks under elasticzero-run against Lightning's DDP)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from ez_testing import require

require(importlib.util.find_spec("lightning") is not None, "lightning not installed (the test extra pins it)")

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from elasticzero.config.load import load_config  # noqa: E402
from elasticzero.errors import UsageError  # noqa: E402
from elasticzero.integrations import lightning as ezl  # noqa: E402


def _cfg(**over: Any) -> Any:
    return load_config({"zero": {"stage": 2}, **over})


def test_precision_flags_map_to_the_engine_dtype_or_are_refused() -> None:
    assert ezl.engine_precision("32-true") is None
    assert ezl.engine_precision("bf16-mixed") == "bf16"
    assert ezl.engine_precision("16-mixed") == "fp16"
    for flag in ("bf16-true", "16-true", "64-true", "transformer-engine"):
        with pytest.raises(UsageError, match="precision='bf16-mixed'"):
            ezl.engine_precision(flag)


def test_clip_norm_takes_whichever_is_set_and_refuses_two_different() -> None:
    assert ezl.clip_norm(None, None) is None
    assert ezl.clip_norm(0.0, None) is None
    assert ezl.clip_norm(1.0, None) == 1.0
    assert ezl.clip_norm(0.0, 0.5) == 0.5
    assert ezl.clip_norm(0.5, 0.5) == 0.5
    with pytest.raises(UsageError, match=r"gradient_clip_val=0\.5"):
        ezl.clip_norm(1.0, 0.5)


def test_auto_values_fill_a_deepspeed_config_from_the_trainer() -> None:
    auto = ezl.auto_values(world_size=2, accumulation=4, clip=None, dtype="bf16")
    ds = {
        "zero_optimization": {"stage": 3},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": "auto"},
    }
    cfg = load_config(ds, auto=auto, world_size=2)
    got = (cfg.zero.stage, cfg.accumulation_steps, cfg.clip_grad_norm, cfg.precision.dtype.value)
    assert got == (3, 4, 0.0, "bf16")


def test_reconcile_takes_the_trainer_values_and_leaves_the_config_alone() -> None:
    cfg = _cfg(accumulation_steps=2, clip_grad_norm=1.0)
    out = ezl.reconcile(cfg, accumulation=2, dtype="bf16", clip=None)
    assert (out.precision.dtype.value, out.clip_grad_norm, out.accumulation_steps) == ("bf16", 1.0, 2)
    assert (cfg.precision.dtype.value, cfg.clip_grad_norm) == ("fp32", 1.0)  # not changed
    assert ezl.reconcile(_cfg(), accumulation=1, dtype=None, clip=0.5).clip_grad_norm == 0.5
    fp16 = ezl.reconcile(_cfg(precision={"dtype": "fp16"}), accumulation=1, dtype=None, clip=None)
    assert fp16.precision.dtype.value == "fp16"  # the config's, under precision="32-true"


@pytest.mark.parametrize(
    ("cfg", "kwargs", "fragment"),
    [
        ({"zero": {"stage": 0}}, {}, "stage 1, 2 or 3"),
        ({"zero": {"stage": 1}, "accumulation_steps": 4}, {"accumulation": 2}, "accumulate_grad_batches=2"),
        ({"zero": {"stage": 3}, "precision": {"dtype": "fp16"}}, {"dtype": "bf16"}, "asks for bf16"),
        ({"zero": {"stage": 2}, "clip_grad_norm": 1.0}, {"clip": 2.0}, r"gradient_clip_val=2\.0"),
    ],
)
def test_reconcile_refuses_a_config_the_trainer_contradicts(
    cfg: dict[str, Any], kwargs: dict[str, Any], fragment: str
) -> None:
    args = {"accumulation": 1, "dtype": None, "clip": None, **kwargs}
    with pytest.raises(UsageError, match=fragment):
        ezl.reconcile(load_config(cfg), **args)


def test_names_are_registered_on_import_with_their_stage() -> None:
    for name in ("elasticzero", "elasticzero_stage_1", "elasticzero_stage_2", "elasticzero_stage_3"):
        assert StrategyRegistry[name]["strategy"] is ezl.ElasticZeroStrategy
    assert StrategyRegistry["elasticzero_stage_3"]["init_params"] == {"stage": 3}
    strategy = StrategyRegistry.get("elasticzero_stage_3")
    assert strategy._overrides == ("zero.stage=3",)
    assert StrategyRegistry.get("elasticzero")._overrides == ("zero.stage=2",)  # no config: stage 2
    assert ezl.ElasticZeroStrategy({"zero": {"stage": 1}})._overrides == ()  # the config's stage


def test_lightning_precision_plugins_become_the_engines() -> None:
    strategy = ezl.ElasticZeroStrategy()
    assert isinstance(strategy.precision_plugin, ezl.ElasticZeroPrecision)
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert isinstance(strategy.precision_plugin, ezl.ElasticZeroPrecision)
    assert strategy.precision_plugin.precision == "bf16-mixed"
    for plugin in (HalfPrecision("bf16-true"), DoublePrecision()):
        with pytest.raises(UsageError, match="fp32 masters"):
            strategy.precision_plugin = plugin


def test_the_plugin_refuses_clipping_by_value_and_an_engine_not_built() -> None:
    plugin = ezl.ElasticZeroPrecision()
    with pytest.raises(UsageError, match="gradient_clip_algorithm='norm'"):
        plugin.clip_gradients(None, 1.0, GradClipAlgorithmType.VALUE)
    with pytest.raises(UsageError, match=r"built in Trainer\.fit"):
        plugin.clip_gradients(None, 0.0, GradClipAlgorithmType.NORM)  # 0: the config's norm, not known yet
    plugin.clip_gradients(None, 0.5, GradClipAlgorithmType.NORM)  # a norm given: recorded for the step
    assert plugin._max_norm == 0.5


def test_a_trainer_with_a_precision_the_engine_has_not_is_refused_when_built() -> None:
    import lightning as L

    with pytest.raises(UsageError, match="fp32 masters"):
        L.Trainer(accelerator="cpu", strategy="elasticzero", precision="bf16-true", logger=False)


def test_a_folder_that_is_not_its_checkpoint_is_refused_before_anything_loads(tmp_path: Any) -> None:
    with pytest.raises(UsageError, match=r"no lightning\.pt"):
        ezl.ElasticZeroStrategy().load_checkpoint(tmp_path)


def test_a_native_config_takes_what_it_leaves_out_from_the_trainer(tmp_path: Any) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("zero: {stage: 3}\noptimizer: {type: AdamW, params: {lr: 0.01}}\n")
    ds = ezl.auto_values(world_size=1, accumulation=4, clip=0.5, dtype="bf16")
    native = ezl.native_values(world_size=1, accumulation=4, clip=0.5, dtype="bf16")
    cfg = ezl.load_engine_config(path, (), ds=ds, native=native)
    got = (cfg.zero.stage, cfg.accumulation_steps, cfg.clip_grad_norm, cfg.precision.dtype.value)
    assert got == (3, 4, 0.5, "bf16")
    unset = ezl.native_values(world_size=1, accumulation=1, clip=None, dtype=None)
    stated = {"zero": {"stage": 1}, "clip_grad_norm": 1.0}
    assert ezl.load_engine_config(stated, (), ds=ds, native=unset).clip_grad_norm == 1.0  # the config's
    with pytest.raises(UsageError, match="accumulation_steps is 2"):
        ezl.load_engine_config({"zero": {"stage": 1}, "accumulation_steps": 2}, (), ds=ds, native=native)
    assert ezl.load_engine_config(None, ("zero.stage=2",), ds=ds, native=unset).zero.stage == 2


def test_the_lightning_internals_the_strategy_relies_on_are_there() -> None:
    """Canary: ``Precision._after_closure`` (run after the closure, before the step: Lightning's
    ``on_before_optimizer_step`` hook and its clip request) still takes ``(model, optimizer)`` and calls the clip, as
    ``ElasticZeroPrecision.optimizer_step`` relies on (the pinned lightning has it; a release that changes it fails
    here)."""
    import inspect

    from lightning.pytorch.plugins.precision import Precision

    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    source = inspect.getsource(Precision._after_closure)
    assert "on_before_optimizer_step" in source and "_clip_gradients" in source, "lightning changed _after_closure"
