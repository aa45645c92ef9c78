"""The HF ``Trainer`` door's decisions (``elasticzero.integrations.hf``), without a process group: the ``"auto"``
values read off real ``TrainingArguments``, which config a run takes and how it is filled, what is refused, the
``Trainer``'s weight-decay groups, and which ``checkpoint-N`` a restart resumes from."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elasticzero.config.auto import AutoValues
from elasticzero.errors import UsageError
from ez_testing import REPO, require

DS_ZERO3 = REPO / "examples" / "configs" / "ds_zero3_hf.json"


@pytest.fixture(scope="module")
def hf() -> Iterator[Any]:
    for name in ("transformers", "accelerate"):
        require(importlib.util.find_spec(name) is not None, f"{name} missing: pip install -e '.[test]'")
    from elasticzero.integrations import hf as door

    yield door


@pytest.fixture
def args(hf: Any, tmp_path: Path) -> Any:
    return hf.ZeroTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        learning_rate=2e-4,
        adam_beta1=0.8,
        adam_beta2=0.9,
        adam_epsilon=1e-6,
        weight_decay=0.05,
        max_grad_norm=0.7,
        warmup_steps=0.1,  # a ratio of the steps
        use_cpu=True,
        report_to="none",
        zero_config=str(DS_ZERO3),
    )


def test_auto_values_are_the_trainer_s_for_deepspeed(hf: Any, args: Any) -> None:
    values = hf.auto_values(args, world_size=2, max_steps=50, hidden=32)
    assert values == AutoValues(
        world_size=2,
        micro_batch_size=4,
        accumulation_steps=3,
        lr=2e-4,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.05,
        clip_grad_norm=0.7,
        fp16=False,
        bf16=False,
        warmup_steps=5,  # the Trainer's get_warmup_steps: ceil(0.1 * 50)
        total_steps=50,
        hidden_size=32,
    )


def test_a_deepspeed_config_s_auto_values_are_filled(hf: Any, args: Any) -> None:
    cfg = hf.engine_config(str(DS_ZERO3), hf.auto_values(args, world_size=1, max_steps=50, hidden=32))
    assert cfg.zero.stage == 3 and cfg.zero.offload.optimizer and cfg.zero.offload.params
    assert (cfg.micro_batch_size, cfg.accumulation_steps, cfg.train_batch_size) == (4, 3, 12)
    assert cfg.optimizer.params == {"lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.05}
    assert cfg.clip_grad_norm == 0.7 and cfg.precision.dtype.value == "fp32"
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-4, "warmup_num_steps": 5}


def test_a_native_config_takes_the_arguments_for_what_it_leaves_out(hf: Any, args: Any) -> None:
    values = hf.auto_values(args, world_size=1, max_steps=50)
    cfg = hf.engine_config({"zero": {"stage": 1}}, values)
    assert (cfg.zero.stage, cfg.micro_batch_size, cfg.accumulation_steps, cfg.clip_grad_norm) == (1, 4, 3, 0.7)
    assert cfg.scheduler.type is None  # none in the config: the Trainer's lr_scheduler_type is used
    with pytest.raises(UsageError, match=r"^<dict>: the config disagrees with the arguments: clip_grad_norm is 1.0"):
        hf.engine_config({"zero": {"stage": 2}, "clip_grad_norm": 1.0}, values)


def test_a_native_yaml_file_is_named_in_its_errors(hf: Any, args: Any, tmp_path: Path) -> None:
    path = tmp_path / "zero.yaml"
    path.write_text("zero: {stage: 0}\n")
    with pytest.raises(UsageError, match=r"zero.yaml: ZeRO stage 0 is plain data parallelism; use transformers"):
        hf.engine_config(str(path), hf.auto_values(args, world_size=1, max_steps=10))
    path.write_text("zero: {stage: 2}\nmicro_batch_size: 2\n")
    with pytest.raises(UsageError, match=r"zero.yaml: the config disagrees .* micro_batch_size is 2 but .* 4"):
        hf.engine_config(str(path), hf.auto_values(args, world_size=1, max_steps=10))


def test_the_config_comes_from_one_place(hf: Any) -> None:
    assert hf.zero_source("a.json", SimpleNamespace(zero_config=None)) == "a.json"
    assert hf.zero_source(None, SimpleNamespace(zero_config="b.yaml")) == "b.yaml"
    assert hf.zero_source("b.yaml", SimpleNamespace(zero_config="b.yaml")) == "b.yaml"
    with pytest.raises(UsageError, match=r"zero_config='a\.json' and --zero_config b\.yaml differ; give one"):
        hf.zero_source("a.json", SimpleNamespace(zero_config="b.yaml"))
    with pytest.raises(UsageError, match="ZeroTrainer needs the engine's config: zero_config="):
        hf.zero_source(None, SimpleNamespace())


def test_what_the_door_cannot_honour_is_refused(hf: Any, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--deepspeed ds.json: runs DeepSpeed's engine; .* --zero_config ds.json"):
        hf.ZeroTrainingArguments(output_dir=str(tmp_path), deepspeed="ds.json")
    with pytest.raises(UsageError, match="pass it as --zero_config instead"):
        hf.check_arguments(SimpleNamespace(deepspeed="ds.json"), (None, None))
    with pytest.raises(UsageError, match="--fsdp shards with FSDP"):
        hf.check_arguments(SimpleNamespace(fsdp="full_shard"), (None, None))
    with pytest.raises(UsageError, match=r"optimizers=\(...\) or optimizer_cls_and_kwargs= is built from the config"):
        hf.check_arguments(SimpleNamespace(), (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), None))
    with pytest.raises(UsageError, match=r"or optimizer_cls_and_kwargs= is built from the config"):
        hf.check_arguments(SimpleNamespace(), (None, None, (torch.optim.SGD, {})))
    with pytest.raises(UsageError, match="--auto_find_batch_size rebuilds the model"):
        hf.check_arguments(SimpleNamespace(auto_find_batch_size=True), (None, None))
    hf.check_arguments(SimpleNamespace(deepspeed=None, fsdp="", auto_find_batch_size=False), (None, None, None))


def test_the_trainer_s_decay_groups(hf: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    model[1].bias.requires_grad_(False)
    groups = hf.decay_groups(model, ["0.weight"])
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(model[0].weight)],
        [id(model[0].bias), id(model[1].weight)],
    ]
    assert "weight_decay" not in groups[0] and groups[1]["weight_decay"] == 0.0  # the config's decay, and none
    assert len(hf.decay_groups(model, [])) == 1  # an empty group is left out


def _checkpoint(root: Path, step: int, *, committed: bool, state: bool) -> None:
    """A ``checkpoint-N`` as the door leaves it: the sharded checkpoint's committed ``step-N`` (its manifest) and the
    Trainer's state, either missing where a lost node cut the save short."""
    shards = root / f"checkpoint-{step}" / "elasticzero" / f"step-{step:08d}"
    shards.mkdir(parents=True)
    if committed:
        (shards / "manifest.json").write_text(json.dumps({}))
    if state:
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")


def test_a_restart_resumes_from_the_newest_complete_checkpoint(hf: Any, tmp_path: Path) -> None:
    assert hf.last_checkpoint(tmp_path / "none") is None and hf.last_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 4, committed=True, state=True)
    _checkpoint(tmp_path, 10, committed=True, state=True)  # numbers, not names, order them: 10 after 4
    _checkpoint(tmp_path, 12, committed=True, state=False)  # cut short after the shards
    _checkpoint(tmp_path, 14, committed=False, state=False)  # cut short while writing them
    (tmp_path / "checkpoint-x").mkdir()
    assert hf.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert [hf.checkpoint_number(n) for n in ("checkpoint-7", "checkpoint-", "checkpoints-7", "run-7")] == [
        7,
        None,
        None,
        None,
    ]


def test_zero_config_is_a_command_line_flag(hf: Any, tmp_path: Path) -> None:
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--zero_config", "ds_config.json", "--use_cpu", "--report_to", "none"]
    (args,) = HfArgumentParser(hf.ZeroTrainingArguments).parse_args_into_dataclasses(argv)
    assert args.zero_config == "ds_config.json" and hf.zero_source(None, args) == "ds_config.json"


def test_the_trainer_internals_the_door_relies_on_are_there(hf: Any) -> None:
    """Canaries: the non-public ``Trainer`` names ``ZeroTrainer`` calls still mean what it relies on (the pinned
    transformers has them; a release that drops or changes one fails here, naming it)."""
    import inspect

    from transformers import Trainer

    params = list(inspect.signature(Trainer._prepare_inputs).parameters)
    assert params == ["self", "inputs"], f"transformers changed Trainer._prepare_inputs{params}; used in hf.py"
    assert "_prepare_input(" in inspect.getsource(Trainer._prepare_inputs)  # moves the batch to the device
