"""DeepSpeed ds_config → elasticzero mapping: a realistic config, the unsupported-key policy, batch-size rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elasticzero.config.deepspeed import looks_like_deepspeed, map_deepspeed
from elasticzero.config.load import load_config, load_deepspeed_config
from elasticzero.config.schema import Precision
from elasticzero.errors import UsageError
from ez_testing import REPO

REALISTIC = """\
// a GPT pre-training config as DeepSpeed users write it (hjson comments are allowed, as DeepSpeed allows them)
{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "steps_per_print": 100,
  "wall_clock_breakdown": true,
  "gradient_clipping": 1.0,
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": true}
  },
  "fp16": {
    "enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
    "hysteresis": 2, "consecutive_hysteresis": false, "min_loss_scale": 1
  },
  "bf16": {"enabled": false},
  "zero_optimization": {
    "stage": 3,
    "reduce_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e6,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "offload_optimizer": {"device": "none"}
  },
  "tensorboard": {"enabled": true, "output_path": "logs/"}
}
"""


def test_realistic_ds_config_maps_every_key(tmp_path: Path) -> None:
    f = tmp_path / "ds_config.json"
    f.write_text(REALISTIC)
    cfg = load_config(f, world_size=4)  # detected as DeepSpeed by its keys
    assert (cfg.zero.stage, cfg.zero.bucket_bytes, cfg.zero.prefetch) == (3, 5 * 10**8 * 4, True)
    assert cfg.precision.dtype is Precision.fp16 and not cfg.precision.reduce_in_low_precision
    ls = cfg.precision.loss_scale
    assert (ls.dynamic, ls.init_scale, ls.growth_interval, ls.hysteresis, ls.min_scale) == (True, 4096.0, 500, 2, 1.0)
    assert not ls.consecutive_hysteresis
    assert cfg.optimizer.type == "AdamW"  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    assert cfg.optimizer.params == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert cfg.clip_grad_norm == 1.0 and cfg.timers.enabled
    assert (cfg.micro_batch_size, cfg.accumulation_steps, cfg.train_batch_size) == (4, 4, 64)  # 64 = 4 x 4 x 4

    _, report = load_deepspeed_config(f, world_size=4)
    assert report.unsupported == []
    ignored = {k for k, _ in report.ignored}
    assert ignored == {
        "steps_per_print",
        "tensorboard",
        "optimizer.params.torch_adam",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.offload_optimizer",
    }
    mapped = dict(report.mapped)
    assert mapped["zero_optimization.stage"] == "zero.stage"
    assert mapped["fp16.initial_scale_power"].startswith("precision.loss_scale.init_scale")
    assert mapped["wall_clock_breakdown"] == "timers.enabled"
    assert "unsupported" not in report.format() and "ignored     tensorboard" in report.format()


def test_example_ds_config_loads_strictly() -> None:
    cfg = load_config(REPO / "examples" / "ds_config.json", world_size=2)
    assert cfg.zero.stage == 2 and cfg.optimizer.type == "AdamW" and cfg.precision.dtype is Precision.fp32


BAD = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_acumulation_steps": 2,
    "scheduler": {"type": "WarmupLR", "parms": {}},
    "fp16": {"enabled": True, "auto_cast": True},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}, "overlap_com": True},
}


def test_unsupported_keys_strict_error_names_all_of_them() -> None:
    with pytest.raises(UsageError) as info:
        load_deepspeed_config(BAD, world_size=2)
    msg = str(info.value)
    assert msg.startswith("<dict>: unsupported DeepSpeed keys: ")
    for expected in (
        'train_micro_batch_size_per_gpu ("auto" needs a value: write it, or fill it with elasticzero.config.fill_auto(',
        "gradient_acumulation_steps (not a DeepSpeed key elasticzero knows; "
        "did you mean 'gradient_accumulation_steps'?)",
        "scheduler.parms (not a DeepSpeed key elasticzero knows; did you mean 'scheduler.params'?)",
        "fp16.auto_cast (inputs are not cast",
        "zero_optimization.offload_optimizer.device (NVMe offload (ZeRO-Infinity) is not provided: use device: cpu",
        "zero_optimization.overlap_com (not a DeepSpeed key elasticzero knows; did you mean "
        "'zero_optimization.overlap_comm'?)",
        "strict=False",
    ):
        assert expected in msg
    assert "\n" not in msg


def test_unsupported_keys_non_strict_warn_and_drop() -> None:
    with pytest.warns(UserWarning, match=r"unsupported DeepSpeed keys: .*scheduler.*\(dropped\)"):
        cfg, report = load_deepspeed_config(BAD, strict=False, world_size=2)
    assert cfg.zero.stage == 2 and cfg.precision.dtype is Precision.fp16
    assert cfg.micro_batch_size == 1 and cfg.accumulation_steps == 1  # "auto" and the typo were dropped
    assert len(report.unsupported) == 6


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type 'Lamb' has no torch.optim equivalent"),
        ({"zero_optimization": {"reduce_bucket_size": 2.5}}, r"reduce_bucket_size must be a whole number, got 2\.5"),
        ({"zero_optimization": {"allgather_bucket_size": None}}, "bucket_size must be a whole number, got None"),
        ({"zero_optimization": {"stage": 5}}, r"zero\.stage must be 0, 1, 2 or 3, got 5"),
        ({"zero_optimization": 2}, "zero_optimization must be a mapping"),
        ({"fp16": True}, r"fp16 must be a mapping like \{\"enabled\": true\}"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, r"precision\.loss_scale\.hysteresis must be >= 1"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}}, "did you mean 'optimizer.params.mom"),
    ],
)
def test_unmappable_values_are_errors(ds: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        load_deepspeed_config(ds, world_size=1)


def test_optimizer_and_loss_scale_variants() -> None:
    adam, _ = load_deepspeed_config({"optimizer": {"type": "adam", "params": {"lr": 0.1, "adam_w_mode": False}}})
    assert adam.optimizer.type == "Adam" and adam.optimizer.params == {"lr": 0.1}
    sgd, _ = load_deepspeed_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert sgd.optimizer.type == "SGD"
    static, _ = load_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert (static.precision.loss_scale.dynamic, static.precision.loss_scale.init_scale) == (False, 128.0)
    low, _ = load_deepspeed_config({"bf16": {"enabled": True}, "communication_data_type": "bf16"})
    assert low.precision.dtype is Precision.bf16 and low.precision.reduce_in_low_precision


def test_prefetch_size_maps_to_on_off() -> None:
    off, _ = map_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}})
    on, _ = map_deepspeed({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}})
    assert (off["zero"]["prefetch"], on["zero"]["prefetch"]) == (False, True)


def test_bucket_bytes_follow_the_reduction_dtype() -> None:
    native, _ = map_deepspeed({"zero_optimization": {"allgather_bucket_size": 1000}})
    assert native["zero"] == {"bucket_bytes": 4000}  # fp32 reduction
    native, rep = map_deepspeed(
        {
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "zero_optimization": {"reduce_bucket_size": 1000, "allgather_bucket_size": 7},
        }
    )
    assert native["zero"] == {"bucket_bytes": 2000}  # bf16 reduction; allgather_bucket_size ignored beside it
    assert "zero_optimization.allgather_bucket_size" in {k for k, _ in rep.ignored}


@pytest.mark.parametrize(
    ("sizes", "world", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 2)),
        ({"train_batch_size": 32}, 8, (4, 1)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, None, (3, 5)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2, (3, 4)),
    ],
)
def test_batch_sizes_resolve_like_deepspeed(
    sizes: dict[str, int], world: int | None, expected: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg, _ = load_deepspeed_config(sizes, world_size=world)
    assert (cfg.micro_batch_size, cfg.accumulation_steps) == expected


@pytest.mark.parametrize(
    ("sizes", "world", "message"),
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            2,
            r"contradictory batch sizes: train_batch_size=32 != micro batch 4 x accumulation 2 x world size 2 = 16",
        ),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, "not divisible by train_micro_batch"),
        ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 2, "not divisible by gradient_accumulation_steps"),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, None, "needs the world size"),
        ({"train_batch_size": 0}, 2, "train_batch_size must be >= 1"),
    ],
)
def test_batch_size_errors(
    sizes: dict[str, int], world: int | None, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UsageError, match=message):
        load_deepspeed_config(sizes, world_size=world)


def test_world_size_comes_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg, _ = load_deepspeed_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2})
    assert cfg.accumulation_steps == 4


def test_format_detection(tmp_path: Path) -> None:
    assert looks_like_deepspeed({"zero_optimization": {}}) and looks_like_deepspeed({"fp16": {}})
    assert not looks_like_deepspeed({"zero": {}, "optimizer": {}, "train_batch_size": 8})
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert load_config(f).zero.stage == 1
    with pytest.raises(UsageError, match="unknown key 'zero_optimization'"):
        load_config(f, format="elasticzero")
    with pytest.warns(UserWarning, match="zero \\(not a DeepSpeed key"):
        assert load_config({"zero": {"stage": 2}}, format="deepspeed", strict=False).zero.stage == 0  # dropped


def test_activation_checkpointing_block_turns_checkpointing_on() -> None:
    ds = {
        "zero_optimization": {"stage": 2},
        "activation_checkpointing": {
            "partition_activations": True,
            "cpu_checkpointing": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 24,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
    }
    cfg, report = load_deepspeed_config(ds, world_size=1)
    ac = cfg.activation_checkpointing
    assert (ac.enabled, ac.cpu, ac.blocks) == (True, True, None)
    mapped, ignored = dict(report.mapped), dict(report.ignored)
    assert mapped["activation_checkpointing"].startswith("activation_checkpointing.enabled")
    assert mapped["activation_checkpointing.cpu_checkpointing"].startswith("activation_checkpointing.cpu")
    assert set(ignored) == {f"activation_checkpointing.{k}" for k in (
        "partition_activations", "contiguous_memory_optimization", "number_checkpoints",
        "synchronize_checkpoint_boundary", "profile")}  # fmt: skip
    assert "model-parallel size 1" in ignored["activation_checkpointing.partition_activations"]
    off, _ = load_deepspeed_config({"zero_optimization": {"stage": 1}}, world_size=1)
    assert not off.activation_checkpointing.enabled
    empty, _ = load_deepspeed_config({"activation_checkpointing": {}}, world_size=1)
    assert empty.activation_checkpointing.enabled and not empty.activation_checkpointing.cpu


def test_activation_checkpointing_typos_and_shapes_are_reported() -> None:
    with pytest.raises(
        UsageError,
        match=r"activation_checkpointing\.cpu_checkpoint \(not a DeepSpeed key elasticzero "
        r"knows; did you mean 'activation_checkpointing\.cpu_checkpointing'\?\)",
    ):
        load_deepspeed_config({"activation_checkpointing": {"cpu_checkpoint": True}}, world_size=1)
    with pytest.raises(UsageError, match="activation_checkpointing must be a mapping, got bool"):
        load_deepspeed_config({"zero_optimization": {}, "activation_checkpointing": True}, world_size=1)
    assert not looks_like_deepspeed({"activation_checkpointing": {"enabled": True}})  # the native schema's key too
    assert not looks_like_deepspeed({"timers": {"enabled": True}})  # DeepSpeed 0.19 has a timers block as well
    native = load_config({"activation_checkpointing": {"enabled": True, "cpu": True, "blocks": "Block"}})
    assert native.activation_checkpointing.blocks == "Block"
