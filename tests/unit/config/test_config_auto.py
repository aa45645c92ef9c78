"""``"auto"`` values (config/auto.py): filled from a front door's arguments by the Hugging Face Trainer's rule, on the
ds_config files its documentation hands out (``data/hf_ds_config_zero{2,3}.json``); without values, loading names each
``"auto"`` key."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elasticzero.config import AutoValues, fill_auto, fill_native, load_config
from elasticzero.config.load import config_from_dict, load_deepspeed_config, read_file
from elasticzero.errors import UsageError

DATA = Path(__file__).parent / "data"
ZERO2, ZERO3 = DATA / "hf_ds_config_zero2.json", DATA / "hf_ds_config_zero3.json"
ARGS = AutoValues(
    world_size=4,
    micro_batch_size=8,
    accumulation_steps=2,
    lr=3e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    clip_grad_norm=1.0,
    fp16=True,
    bf16=False,
    warmup_steps=100,
    total_steps=5000,
    hidden_size=64,
)


def _autos(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [k for key, v in tree.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if tree == "auto" else []


def test_the_trainers_rule_fills_every_auto_of_the_published_zero2_config() -> None:
    published = read_file(ZERO2)
    before = copy.deepcopy(published)
    filled = fill_auto(published, ARGS)
    assert published == before  # a copy: the argument is untouched
    assert _autos(filled) == []
    assert filled["train_batch_size"] == 4 * 8 * 2
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (8, 2)
    assert filled["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}
    assert filled["gradient_clipping"] == 1.0 and filled["fp16"]["enabled"] is True
    assert filled["zero_optimization"]["reduce_bucket_size"] == 2e8  # stated: only "auto" is filled


def test_zero3_sizes_come_from_the_hidden_size_as_the_trainer_derives_them() -> None:
    zero = fill_auto(read_file(ZERO3), ARGS)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 10 * 64


@pytest.mark.filterwarnings("ignore:<dict>. unsupported DeepSpeed keys. zero_optimization.offload_:UserWarning")
@pytest.mark.parametrize("path", [ZERO2, ZERO3])
def test_filled_published_configs_load_with_the_schedule(path: Path) -> None:
    """Every key maps once filled, apart from the offload blocks (another part of the engine's work)."""
    cfg, report = load_deepspeed_config(fill_auto(read_file(path), ARGS), strict=False, world_size=4)
    assert all(key.startswith("zero_optimization.offload_") for key, _ in report.unsupported), report.unsupported
    assert (cfg.micro_batch_size, cfg.accumulation_steps, cfg.train_batch_size) == (8, 2, 64)
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}
    assert cfg.optimizer.params["betas"] == [0.9, 0.95] and cfg.clip_grad_norm == 1.0


def test_load_config_fills_auto_with_the_resolved_world_size(tmp_path: Path) -> None:
    doc = read_file(ZERO2)
    del doc["zero_optimization"]["offload_optimizer"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    values = AutoValues(micro_batch_size=2, accumulation_steps=3, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.0, clip_grad_norm=0.5, fp16=False, warmup_steps=10)  # fmt: skip
    cfg = load_config(path, world_size=2, auto=values)
    assert cfg.train_batch_size == 2 * 2 * 3 and cfg.precision.dtype.value == "fp32"
    assert cfg.scheduler.params["warmup_num_steps"] == 10


def test_without_values_each_auto_is_named() -> None:
    with pytest.raises(UsageError) as info:
        load_config(ZERO2, world_size=1)
    msg = str(info.value)
    for key in _autos(read_file(ZERO2)):
        assert f'{key} ("auto" needs a value: write it, or fill it with elasticzero.config.fill_auto(' in msg, key


def test_an_auto_with_no_value_stays_and_is_named() -> None:
    filled = fill_auto(read_file(ZERO2), AutoValues(lr=1e-3))
    assert filled["optimizer"]["params"]["lr"] == 1e-3 and filled["train_batch_size"] == "auto"
    with pytest.raises(UsageError, match=r"train_batch_size \(\"auto\" needs a value"):
        load_deepspeed_config(filled, world_size=1)


def test_a_stated_value_that_disagrees_with_the_arguments_is_one_error() -> None:
    stated = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "optimizer": {"params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-6}}}  # fmt: skip
    values = AutoValues(micro_batch_size=8, lr=1e-3, clip_grad_norm=1.0, warmup_min_lr=0.0)
    with pytest.raises(UsageError) as info:
        fill_auto(stated, values, source="ds.json")
    msg = str(info.value)
    assert msg.startswith("ds.json: the config disagrees with the arguments: ") and "\n" not in msg
    assert "train_micro_batch_size_per_gpu is 4 but the arguments say 8" in msg
    assert "gradient_clipping is 0.5 but the arguments say 1.0" in msg
    assert "lr" not in msg.split("arguments: ")[1].split("(")[0]  # it agrees
    assert "warmup_min_lr" not in msg  # only filled, never checked (the Trainer's rule)
    assert fill_auto(stated, values, check=False) == stated


def test_train_batch_takes_stated_micro_and_accumulation() -> None:
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}
    assert fill_auto(cfg, AutoValues(world_size=2))["train_batch_size"] == 24
    assert fill_auto(cfg, AutoValues())["train_batch_size"] == "auto"  # no world size: left for the loader to name


# ---- native configs: what they leave out comes from the arguments, what they state must agree -------------------


def test_a_native_config_takes_what_it_leaves_out_from_the_arguments() -> None:
    native = {"zero": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    filled = fill_native(native, ARGS)
    assert filled["micro_batch_size"] == 8 and filled["accumulation_steps"] == 2
    assert filled["train_batch_size"] == 4 * 8 * 2 and filled["clip_grad_norm"] == 1.0
    assert filled["optimizer"] == {"params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    assert filled["precision"] == {"dtype": "fp16"}
    assert filled["zero"] == {"stage": 2} and filled["scheduler"] == native["scheduler"]  # the engine's own keys
    assert native == {"zero": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}


def test_a_native_config_s_stated_keys_must_agree_with_the_arguments() -> None:
    agreeing = {"micro_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
    assert fill_native(agreeing, ARGS)["optimizer"]["params"]["lr"] == 3e-4
    with pytest.raises(UsageError) as info:
        fill_native(
            {"micro_batch_size": 4, "clip_grad_norm": 0.0, "precision": {"dtype": "bf16"}}, ARGS, source="t.yaml"
        )
    msg = str(info.value)
    assert (
        msg.startswith("t.yaml: the config disagrees with the arguments: micro_batch_size is 4 but") and "\n" not in msg
    )
    assert "clip_grad_norm is 0.0 but the arguments say 1.0" in msg and "precision.dtype is 'bf16'" in msg


def test_a_native_config_keeps_what_the_arguments_do_not_say() -> None:
    quiet = AutoValues(world_size=2, micro_batch_size=4, accumulation_steps=1, fp16=False, bf16=False)
    filled = fill_native({"precision": {"dtype": "bf16"}, "optimizer": {"type": "SGD"}}, quiet)
    assert filled["precision"] == {"dtype": "bf16"} and filled["optimizer"] == {"type": "SGD"}
    sgd = fill_native({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, replace(ARGS, lr=0.1))
    assert sgd["optimizer"]["params"] == {"lr": 0.1, "weight_decay": 0.1}  # no betas/eps for a non-Adam optimizer


def test_a_native_config_filled_loads() -> None:
    cfg = config_from_dict(fill_native({"zero": {"stage": 3}}, replace(ARGS, fp16=False)), world_size=4)
    assert (cfg.zero.stage, cfg.micro_batch_size, cfg.accumulation_steps, cfg.train_batch_size) == (3, 8, 2, 64)
    assert cfg.optimizer.params["betas"] == [0.9, 0.95] and cfg.precision.dtype.value == "fp32"
