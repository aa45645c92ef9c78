"""ZeRO-Offload in the config: DeepSpeed's offload_optimizer / offload_param (0.19's keys) mapped, ignored with a
reason or refused in one line, and the native zero.offload block."""

from __future__ import annotations

from typing import Any

import pytest

from elasticzero.config.load import load_config, load_deepspeed_config
from elasticzero.errors import UsageError

# the offload blocks of the Hugging Face docs' ds_config_zero2.json / ds_config_zero3.json
HF_ZERO2 = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True}
HF_ZERO3 = {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True},
}


def ds(zero: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}


def test_hf_zero2_offload_maps_to_the_host_optimizer() -> None:
    cfg, report = load_deepspeed_config(ds(HF_ZERO2), world_size=1)
    off = cfg.zero.offload
    assert (off.optimizer, off.params, off.pin_memory, off.ratio) == (True, False, True, 1.0)
    mapped = dict(report.mapped)
    assert mapped["zero_optimization.offload_optimizer.device"] == "zero.offload.optimizer=true"
    assert mapped["zero_optimization.offload_optimizer.pin_memory"].startswith("zero.offload.pin_memory")


def test_hf_zero3_offload_maps_parameters_too() -> None:
    cfg, _ = load_deepspeed_config(ds(HF_ZERO3), world_size=1)
    assert cfg.zero.offload.optimizer and cfg.zero.offload.params and cfg.zero.offload.pin_memory


def test_pin_memory_follows_deepspeeds_default_of_pageable() -> None:
    cfg, _ = load_deepspeed_config(ds({"stage": 2, "offload_optimizer": {"device": "cpu"}}), world_size=1)
    assert cfg.zero.offload.optimizer and not cfg.zero.offload.pin_memory


def test_ratio_is_the_budget_and_nvme_swap_sizes_are_ignored_with_their_reason() -> None:
    block = {"device": "cpu", "ratio": 0.3, "buffer_count": 8, "fast_init": True, "super_offload": True}
    cfg, report = load_deepspeed_config(ds({"stage": 3, "offload_optimizer": block}), world_size=1)
    assert cfg.zero.offload.ratio == pytest.approx(0.3)
    ignored = dict(report.ignored)
    assert "no effect with device cpu" in ignored["zero_optimization.offload_optimizer.buffer_count"]
    assert "no effect with device cpu" in ignored["zero_optimization.offload_optimizer.fast_init"]
    assert "overlaps backward" in ignored["zero_optimization.offload_optimizer.super_offload"]
    assert report.unsupported == []


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_nvme_is_refused_in_one_line_saying_what_to_use(block: str) -> None:
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, block: {"device": "nvme", "nvme_path": "/nvme"}}
    with pytest.raises(UsageError) as err:
        load_deepspeed_config(ds(zero), world_size=1)
    msg = str(err.value)
    assert f"zero_optimization.{block}.device (NVMe offload (ZeRO-Infinity) is not provided: use device: cpu" in msg
    assert "\n" not in msg


def test_a_typo_inside_an_offload_block_is_named() -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}
    with pytest.raises(UsageError, match=r"offload_optimizer\.pin_memroy .*did you mean .*pin_memory"):
        load_deepspeed_config(ds(zero), world_size=1)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_param_below_stage3_is_refused_in_one_line(stage: int) -> None:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    with pytest.raises(UsageError, match=r"zero\.offload\.params is for ZeRO stage 3 only") as err:
        load_deepspeed_config(ds(zero), world_size=1)
    assert "\n" not in str(err.value)


def test_offload_param_alone_says_it_needs_the_optimizer_offload() -> None:
    with pytest.raises(UsageError, match=r"needs zero\.offload\.optimizer: true"):
        load_deepspeed_config(ds({"stage": 3, "offload_param": {"device": "cpu"}}), world_size=1)


def test_device_none_is_offload_off() -> None:
    cfg, report = load_deepspeed_config(ds({"stage": 2, "offload_optimizer": {"device": "none"}}), world_size=1)
    assert not cfg.zero.offload.optimizer
    assert dict(report.ignored)["zero_optimization.offload_optimizer"] == "offload off (device: none)"


def test_deprecated_booleans() -> None:
    zero = {"stage": 3, "cpu_offload": True, "cpu_offload_params": True, "cpu_offload_use_pin_memory": True}
    cfg, _ = load_deepspeed_config(ds(zero), world_size=1)
    off = cfg.zero.offload
    assert (off.optimizer, off.params, off.pin_memory) == (True, True, True)


def test_native_block_and_its_checks() -> None:
    cfg = load_config({"zero": {"stage": 1, "offload": {"optimizer": True, "device_budget_bytes": 1 << 20}}})
    assert cfg.zero.offload.optimizer and cfg.zero.offload.device_budget_bytes == 1 << 20
    assert cfg.zero.offload.pin_memory and cfg.zero.offload.step_in_backward  # the native defaults
    with pytest.raises(UsageError, match=r"zero\.offload needs a ZeRO stage"):
        load_config({"zero": {"stage": 0, "offload": {"optimizer": True}}})
    with pytest.raises(UsageError, match=r"zero.offload.ratio must be in \[0, 1\]"):
        load_config({"zero": {"stage": 2, "offload": {"optimizer": True, "ratio": 2.0}}})
