"""Elastic batch planning: one global batch at every world size, DeepSpeed's elasticity block, start checks."""

from __future__ import annotations

import pytest

from elasticzero.config.elastic import (
    BatchPlan,
    ElasticBatch,
    batch_plan,
    check_world_range,
    deepspeed_global_batch,
    elastic_batch,
)
from elasticzero.config.load import config_from_dict, load_config, load_deepspeed_config
from elasticzero.errors import UsageError

DS_10K = {  # DeepSpeed's own elasticity unit-test config (tests/unit/elasticity/test_elastic.py)
    "elasticity": {
        "enabled": True,
        "max_train_batch_size": 10000,
        "micro_batch_sizes": [8, 12, 16, 17],
        "min_gpus": 32,
        "max_gpus": 1500,
        "min_time": 20,
        "version": 0.1,
    },
    "zero_optimization": {"stage": 2},
}


def test_deepspeed_elasticity_block_gives_deepspeeds_batch_and_world_sizes() -> None:
    cfg, report = load_deepspeed_config(DS_10K)
    batch = elastic_batch(cfg)
    assert batch is not None and batch.global_batch_size == 9792  # DeepSpeed's figures for this config
    assert len(batch.valid_world_sizes()) == 23
    assert batch.require(64) == BatchPlan(9792, 17, 9, 64)
    assert ("elasticity.min_gpus", "elasticity.min_world_size") in report.mapped
    assert ("elasticity.min_time", "a hint for the resource scheduler") in report.ignored
    with pytest.raises(UsageError, match=r"world size 128 has no batch plan: global batch 9792 .*valid world sizes: "):
        load_config(DS_10K, world_size=128)


@pytest.mark.parametrize(
    ("max_batch", "micros", "world", "expected"),
    [
        (32, (1, 2, 3, 7), 4, BatchPlan(24, 3, 2, 4)),  # DeepSpeed test_proper_mbsz
        (100, (8, 10, 12), 2, BatchPlan(96, 12, 4, 2)),  # stays <= max_train_batch_size
        (24, (2, 4), 3, BatchPlan(24, 4, 2, 3)),
    ],
)
def test_global_batch_choice(max_batch: int, micros: tuple[int, ...], world: int, expected: BatchPlan) -> None:
    g = deepspeed_global_batch(max_batch, micros)
    assert g == expected.global_batch_size and ElasticBatch(g, micros).plan(world) == expected


def test_elastic_native_config_keeps_the_global_batch_at_every_world_size() -> None:
    data = {"elasticity": {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 4]}}
    plans = {w: config_from_dict(data, world_size=w) for w in (1, 2, 3, 4, 6, 12)}
    assert {c.train_batch_size for c in plans.values()} == {24}
    assert {w: (c.micro_batch_size, c.accumulation_steps) for w, c in plans.items()} == {
        1: (4, 6), 2: (4, 3), 3: (4, 2), 4: (2, 3), 6: (4, 1), 12: (2, 1)
    }  # fmt: skip
    with pytest.raises(UsageError, match=r"world size 5 has no batch plan.*\(valid world sizes: 1-4, 6, 12\)"):
        config_from_dict(data, world_size=5)


def test_train_batch_size_with_micro_derives_accumulation_per_world() -> None:
    data = {"train_batch_size": 16, "micro_batch_size": 4}
    assert [config_from_dict(data, world_size=w).accumulation_steps for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(UsageError, match=r"^<dict>: world size 3 has no batch plan: global batch 16 is not micro"):
        config_from_dict(data, world_size=3)
    # an override of the global (or micro) batch re-derives the file's accumulation
    cfg = config_from_dict({**data, "accumulation_steps": 2}, overrides=["train_batch_size=32"], world_size=2)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps) == (32, 4, 4)
    # all three stated: checked, not derived (the world size is pinned)
    with pytest.raises(UsageError, match="contradictory batch sizes"):
        config_from_dict({**data, "accumulation_steps": 2}, world_size=1)


def test_check_world_range_fails_at_start_for_a_world_without_plan() -> None:
    batch = ElasticBatch(16, (4,), source="train.yaml")
    check_world_range(batch, 1, 2, 2)  # worlds 2 and 4
    with pytest.raises(UsageError) as err:
        check_world_range(batch, 1, 3, 2)
    assert str(err.value) == (
        "train.yaml: --nnodes 1:3 x --nproc-per-node 2 allows world size(s) 6 with no batch plan for global batch 16 "
        "(valid world sizes: 1-2, 4); narrow --nnodes or change the batch sizes"
    )


def test_node_size_v02_counts_whole_nodes() -> None:
    ds = {"elasticity": {**DS_10K["elasticity"], "version": 0.2, "num_gpus_per_node": 8, "min_gpus": 8}}
    batch = elastic_batch(load_deepspeed_config(ds)[0])
    assert batch is not None and batch.node_size == 8
    assert batch.valid_world_sizes() and all(w % 8 == 0 for w in batch.valid_world_sizes())
    assert batch.plan(12) is None


@pytest.mark.parametrize(
    ("elasticity", "match"),
    [
        ({"micro_batch_sizes": [2]}, r"elasticity.max_train_batch_size must be >= 1 when elasticity is enabled, got"),
        ({"max_train_batch_size": 8}, r"elasticity.micro_batch_sizes must be a non-empty list of sizes >= 1, got \[\]"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [16]}, r"micro_batch_sizes must all be <= max_train_batch_"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "min_world_size": 4, "max_world_size": 2},
         r"elasticity.max_world_size must be >= min_world_size=4, got 2"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [8], "min_world_size": 2},
         r"elasticity: no global batch <= max_train_batch_size=8 splits into micro batches \[8\] at any world"),
    ],
)  # fmt: skip
def test_bad_elasticity_block_is_one_clear_line(elasticity: dict, match: str) -> None:
    with pytest.raises(UsageError, match=r"^<dict>: .*" + match):
        config_from_dict({"elasticity": {"enabled": True, **elasticity}})


def test_batch_keys_with_elasticity_follow_deepspeeds_rule() -> None:
    block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 4]}
    with pytest.raises(
        UsageError, match=r"train_batch_size cannot be set with elasticity.enabled .*ignore_non_elastic"
    ):
        config_from_dict({"train_batch_size": 8, "elasticity": block}, world_size=2)
    with pytest.raises(UsageError, match=r"train_batch_size, train_micro_batch_size_per_gpu cannot be set with elas"):
        load_deepspeed_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "elasticity": block})
    lenient = {**block, "ignore_non_elastic_batch_info": True}
    cfg, report = load_deepspeed_config({"train_batch_size": 8, "elasticity": lenient}, world_size=2)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps) == (24, 4, 3)
    assert ("train_batch_size", "elasticity decides the batch sizes (ignore_non_elastic_batch_info)") in report.ignored


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"version": 0.3}, r"elasticity.version \(elasticity versions 0.1 and 0.2 only\)"),
        ({"model_parallel_size": 2}, r"elasticity.model_parallel_size \(model parallelism is not provided\)"),
        ({"max_gpu": 4},
         r"elasticity.max_gpu \(not a DeepSpeed key elasticzero knows; did you mean 'elasticity.max_gpus'"),
    ],
)  # fmt: skip
def test_unsupported_deepspeed_elasticity_keys(extra: dict, match: str) -> None:
    block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 4], **extra}
    with pytest.raises(UsageError, match=match):
        load_deepspeed_config({"elasticity": block, "zero_optimization": {"stage": 1}})


def test_disabled_block_is_ignored_and_batch_sizes_stay_as_given() -> None:
    ds = {"elasticity": {"enabled": False}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    cfg, report = load_deepspeed_config(ds, world_size=2)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.accumulation_steps) == (None, 2, 3)
    assert ("elasticity", "elasticity.enabled is false") in report.ignored
    assert elastic_batch(cfg) is None


def test_build_pieces_plans_an_elastic_config_for_the_running_world(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from elasticzero.config.build import build_pieces

    cfg = config_from_dict({"elasticity": {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 4]}})
    assert (cfg.train_batch_size, cfg.accumulation_steps) == (24, 1)  # loaded before any world existed
    monkeypatch.setenv("WORLD_SIZE", "4")  # the job runs at 4 ranks
    pieces = build_pieces(torch.nn.Linear(2, 2), cfg)
    assert (pieces.micro_batch_size, pieces.accumulation_steps) == (2, 3)  # 24 = 2 x 3 x 4
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(UsageError, match=r"^config: world size 5 has no batch plan"):
        build_pieces(torch.nn.Linear(2, 2), cfg)


def test_batch_plan_is_the_plan_at_the_running_world() -> None:
    block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 4]}
    elastic = config_from_dict({"elasticity": block})
    assert [batch_plan(elastic, w) for w in (1, 4)] == [BatchPlan(24, 4, 6, 1), BatchPlan(24, 2, 3, 4)]
    with pytest.raises(UsageError, match=r"^config: world size 5 has no batch plan"):
        batch_plan(elastic, 5)
    fixed = config_from_dict({"train_batch_size": 16, "micro_batch_size": 4}, world_size=2)
    assert batch_plan(fixed, 2) == BatchPlan(16, 4, 2, 2)
    with pytest.raises(UsageError, match=r"^config: contradictory batch sizes: train_batch_size=16 != micro batch 4"):
        batch_plan(fixed, 4)  # loaded for world 2 (accumulation 2), running at 4
    follows = config_from_dict({"micro_batch_size": 3, "accumulation_steps": 2})  # the global batch follows the world
    assert batch_plan(follows, 5) == BatchPlan(30, 3, 2, 5)
