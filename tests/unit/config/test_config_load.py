"""Native config loading: YAML/JSON/hjson, overrides, and every error message (unknown key, type, range, batch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticzero.config.load import config_from_dict, load_config, read_file
from elasticzero.config.schema import EngineConfig, Precision
from elasticzero.errors import UsageError

YAML = """\
zero: {stage: 2, bucket_bytes: 1048576}
precision:
  dtype: fp16
  loss_scale: {init_scale: 1024, hysteresis: 1}
optimizer: {type: adamw, params: {lr: 3e-4, betas: [0.9, 0.95], weight_decay: 0.1}}
timers: {enabled: true}
clip_grad_norm: 1.0
accumulation_steps: 4
micro_batch_size: 2
train_batch_size: 16
"""


def test_yaml_file_maps_onto_the_schema(tmp_path: Path) -> None:
    f = tmp_path / "engine.yaml"
    f.write_text(YAML)
    cfg = load_config(f, world_size=2)
    assert isinstance(cfg, EngineConfig)
    assert (cfg.zero.stage, cfg.zero.bucket_bytes, cfg.zero.prefetch) == (2, 1048576, None)
    r = cfg.zero.copies
    assert (r.enabled, r.node_shift, r.overlap, r.early) == (True, 1, True, True)
    assert cfg.precision.dtype is Precision.fp16
    assert (cfg.precision.loss_scale.init_scale, cfg.precision.loss_scale.hysteresis) == (1024.0, 1)
    assert cfg.precision.loss_scale.growth_interval == 1000  # default kept
    assert cfg.optimizer.type == "adamw"
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}  # 3e-4 is a float
    assert cfg.timers.enabled and not cfg.timers.synchronize
    assert (cfg.clip_grad_norm, cfg.accumulation_steps, cfg.micro_batch_size, cfg.train_batch_size) == (1.0, 4, 2, 16)


def test_the_old_name_of_the_copies_block_is_still_read(tmp_path: Path) -> None:
    f = tmp_path / "old.yaml"
    f.write_text("zero:\n  replicas:\n    early: false\n")
    cfg = load_config(f, world_size=1, overrides=["zero.replicas.node_shift=2"])
    assert (cfg.zero.copies.early, cfg.zero.copies.node_shift) == (False, 2)


def test_defaults_from_an_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert load_config(f) == EngineConfig()


def test_hjson_comments_and_trailing_commas(tmp_path: Path) -> None:
    f = tmp_path / "engine.hjson"
    f.write_text(
        """{
  # hash comment
  // line comment
  zero: { stage: 3, prefetch: false, reshard_after_forward: false, },   /* block comment */
  accumulation_steps: 2
}"""
    )
    cfg = load_config(f)
    z = cfg.zero
    assert (z.stage, z.prefetch, z.reshard_after_forward, cfg.accumulation_steps) == (3, False, False, 2)


def test_json_file_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "engine.json"
    f.write_text('{"zero": {"stage": 1}, "precision": {"dtype": "bf16"}}')
    cfg = load_config(f, overrides=["zero.stage=3", "optimizer.params.lr=0.5"])
    assert (cfg.zero.stage, cfg.precision.dtype, cfg.optimizer.params["lr"]) == (3, Precision.bf16, 0.5)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"zero": {"stagee": 2}}, r"<dict>: unknown key 'zero\.stagee'; did you mean 'zero\.stage'\? \(valid here: "),
        ({"precison": {}}, r"unknown key 'precison'; did you mean 'precision'\?"),
        ({"grad_accum": 2}, r"unknown key 'grad_accum' \(valid here: zero, precision,"),
        ({"precision": {"loss_scale": {"windw": 3}}}, r"'precision\.loss_scale\.windw'"),
        ({"zero": 3}, r"'zero' must be a mapping of keys, got 3"),
        ({"zero": {"stage": "two"}}, r"wrong type for 'zero\.stage': Value 'two' of type 'str' could not be converted"),
        ({"clip_grad_norm": [1]}, r"wrong type for 'clip_grad_norm'"),
        ({"precision": {"dtype": "fp8"}}, r"wrong type for 'precision\.dtype': Invalid value 'fp8', expected one of"),
        ({"zero": {"stage": 4}}, r"zero\.stage must be 0, 1, 2 or 3, got 4"),
        ({"zero": {"bucket_bytes": 0}}, r"zero\.bucket_bytes must be > 0"),
        ({"zero": {"copies": {"node_shift": 0}}}, r"zero\.copies\.node_shift must be >= 1, got 0"),
        ({"zero": {"copies": {"enabld": False}}}, r"'zero\.copies\.enabld'"),
        ({"zero": {"replicas": {"early": False}, "copies": {}}}, r"'zero\.replicas' is the old name of 'zero\.copies'"),
        ({"accumulation_steps": 0}, r"accumulation_steps must be >= 1, got 0"),
        ({"micro_batch_size": -1}, r"micro_batch_size must be >= 1"),
        ({"clip_grad_norm": -1.0}, r"clip_grad_norm must be >= 0"),
        ({"precision": {"loss_scale": {"growth_factor": 0.5}}}, r"growth_factor must be > 1"),
        ({"precision": {"loss_scale": {"backoff_factor": 2}}}, r"backoff_factor must be in \(0, 1\)"),
        ({"precision": {"loss_scale": {"growth_interval": 0}}}, r"growth_interval must be >= 1"),
        ({"precision": {"loss_scale": {"hysteresis": 0}}}, r"hysteresis must be >= 1"),
        ({"precision": {"loss_scale": {"min_scale": 1e9}}}, r"min_scale must be in \(0, init_scale=65536\]"),
        ({"optimizer": {"type": "Adamm"}}, r"optimizer\.type 'Adamm' is not a torch\.optim optimizer; did you mean"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 1, "momentom": 0.9}}}, r"'optimizer\.params\.momentom' for "),
        ({"train_batch_size": 10, "micro_batch_size": 4}, r"train_batch_size=10 is not a multiple of micro batch 4"),
    ],
)
def test_error_messages_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        config_from_dict(data)
    assert "\n" not in str(info.value)


def test_unknown_key_error_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "engine.yaml"
    f.write_text("zero:\n  stage: 2\n  reduce_bucket_bytes: 5\n")
    with pytest.raises(UsageError, match=rf"^{f}: unknown key 'zero\.reduce_bucket_bytes'; did you mean 'zero\.bucket"):
        load_config(f)


def test_contradictory_batch_sizes_with_the_world_size() -> None:
    data = {"train_batch_size": 32, "micro_batch_size": 4, "accumulation_steps": 2}
    assert config_from_dict(data, world_size=4).train_batch_size == 32
    with pytest.raises(UsageError, match=r"contradictory batch sizes: train_batch_size=32 != micro batch 4 x "):
        config_from_dict(data, world_size=2)


def test_bad_overrides_are_named() -> None:
    with pytest.raises(UsageError, match=r"^overrides: unknown key 'zero\.stag'; did you mean 'zero\.stage'"):
        config_from_dict({}, overrides=["zero.stag=1"])
    with pytest.raises(UsageError, match=r"^overrides: wrong type for 'zero\.stage'"):
        config_from_dict({}, overrides=["zero.stage=x"])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read config"):
        read_file(tmp_path / "missing.json")
    dup = tmp_path / "dup.json"
    dup.write_text('{"zero": {"stage": 1, "stage": 2}}')
    with pytest.raises(UsageError, match=r"dup\.json: duplicate key 'stage'"):
        read_file(dup)
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero": {"stage": 1,, }')
    with pytest.raises(UsageError, match=r"bad\.json: invalid JSON/hjson: .*line 1"):
        read_file(bad)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("zero: [1, 2\n")
    with pytest.raises(UsageError, match=r"bad\.yaml: invalid YAML"):
        read_file(bad_yaml)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    with pytest.raises(UsageError, match="top level must be a mapping"):
        read_file(top)


def test_unknown_format_is_an_error() -> None:
    with pytest.raises(UsageError, match="unknown config format 'toml'"):
        load_config({}, format="toml")
