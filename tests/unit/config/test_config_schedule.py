"""LR schedules (engine/lr_schedules.py, the config's ``scheduler``): the learning rate at every optimizer step equals
what DeepSpeed's own schedule classes set (``data/deepspeed_lr_schedules.json``, made by ``make_ds_lr_fixtures.py``
in a DeepSpeed venv), through ``EnginePieces.step()`` too — which, like DeepSpeed's engine, does not step the schedule
on a skipped fp16 overflow step —, and the config checks."""

from __future__ import annotations

import inspect
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elasticzero.config.build import build_pieces
from elasticzero.config.load import load_config
from elasticzero.config.schedules import REQUIRED, SCHEDULE_PARAMS, check_schedule
from elasticzero.engine.lr_schedules import SCHEDULES, build_schedule
from elasticzero.errors import UsageError
from ez_testing import free_port

FIXTURE = json.loads((Path(__file__).parent / "data" / "deepspeed_lr_schedules.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}


def _optimizer(case: dict[str, Any]) -> torch.optim.Optimizer:
    groups = [{"params": [nn.Parameter(torch.zeros(2))]} for _ in range(case["groups"])]
    return getattr(torch.optim, case["optimizer"])(groups, lr=case["lr"])


def _same_double(got: float, want: float) -> bool:
    """Our schedules do DeepSpeed's float operations in DeepSpeed's order on IEEE doubles, so the values are
    bit-identical where ``math.log``/``math.cos`` are (here they are: the fixture was made with this machine's libm).
    Another C library may round those two functions differently by 1 ulp, which the following arithmetic can carry
    to a few ulps: 4 ulps allow that and nothing else — the smallest real error (a step off by one in a warmup or
    decay of <= 1200 steps) moves the value by >= 1/1200 of it, ~10^12 ulps."""
    return abs(got - want) <= 4 * math.ulp(want)


def test_the_fixture_is_deepspeed_0_19_and_covers_every_type() -> None:
    assert FIXTURE["deepspeed"].startswith("0.19.")
    assert {c["type"] for c in CASES.values()} == set(SCHEDULES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_step_runs_at_deepspeeds_learning_rate(name: str) -> None:
    case = CASES[name]
    opt = _optimizer(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OneCycle on SGD: DeepSpeed's warning, ours is a log line
        sched = build_schedule(opt, case["type"], case["params"])
    for step, (lrs, betas) in enumerate(zip(case["lrs"], case["betas"], strict=True)):
        got = [g["lr"] for g in opt.param_groups]
        assert all(map(_same_double, got, lrs)), (step, got, lrs)
        if betas is not None:
            got_betas = [list(g["betas"]) for g in opt.param_groups]
            pairs = [ab for x, y in zip(got_betas, betas, strict=True) for ab in zip(x, y, strict=True)]
            assert all(_same_double(a, b) for a, b in pairs), (step, got_betas, betas)
        opt.step()
        sched.step()
    assert sched.last_batch_iteration == case["params"].get("last_batch_iteration", -1) + len(case["lrs"])


@pytest.mark.parametrize("name", ["decay_log", "cosine_linear", "onecycle_decay", "range_staircase", "warmup_resume"])
def test_state_dict_resumes_the_sequence_on_a_fresh_optimizer(name: str) -> None:
    """Saved after 7 steps, loaded into a schedule built from the config on a fresh optimizer (its lr the config's):
    the next steps run at DeepSpeed's values for steps 8, 9, ... — the state sets the optimizer's lr itself."""
    case = CASES[name]
    opt = _optimizer(case)
    sched = build_schedule(opt, case["type"], case["params"])
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert state == {"last_batch_iteration": case["params"].get("last_batch_iteration", -1) + 7}

    fresh = _optimizer(case)
    resumed = build_schedule(fresh, case["type"], case["params"])
    resumed.load_state_dict(dict(state))
    for step in range(7, len(case["lrs"])):
        assert [g["lr"] for g in fresh.param_groups] == case["lrs"][step], step
        if case["betas"][step] is not None:
            assert [list(g["betas"]) for g in fresh.param_groups] == case["betas"][step], step
        fresh.step()
        resumed.step()


# ------------------------------------------------------------------------------------------------ checks
@pytest.mark.parametrize(
    ("name", "params", "needle"),
    [
        ("WarmupLr", {}, "scheduler.type 'WarmupLr' is not a known schedule; did you mean 'WarmupLR'?"),
        ("StepLR", {}, "valid: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
        ("WarmupLR", {"warmup_num_step": 5}, "unknown key 'scheduler.params.warmup_num_step' for WarmupLR; did you "
         "mean 'scheduler.params.warmup_num_steps'?"),
        ("WarmupLR", {"total_num_steps": 5}, "unknown key 'scheduler.params.total_num_steps' for WarmupLR"),
        ("WarmupDecayLR", {"warmup_num_steps": 5}, "WarmupDecayLR needs scheduler.params.total_num_steps"),
        ("OneCycle", {"cycle_min_lr": 0.1}, "OneCycle needs scheduler.params.cycle_max_lr"),
        ("WarmupLR", {"warmup_type": "linaer"}, "scheduler.params.warmup_type must be 'log' or 'linear', got 'linaer'"),
        ("WarmupLR", {"warmup_num_steps": -1}, "scheduler.params.warmup_num_steps must be a whole number >= 0, got -1"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, "warmup_num_steps must be a whole number >= 0, got 2.5"),
        ("WarmupLR", {"warmup_max_lr": "1e-3"}, "warmup_max_lr must be a learning rate >= 0, a list of them or null"),
        ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": -1}, "cos_min_ratio must be a number >= 0"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size must be a whole number >= 1"),
        ("LRRangeTest", {"lr_range_test_staircase": 1}, "lr_range_test_staircase must be true or false, got 1"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_second_step_size": -1},
         "cycle_second_step_size must be a whole number >= 0 (or null)"),
        ("WarmupDecayLR", {"total_num_steps": 10, "last_batch_iteration": -2}, "last_batch_iteration must be a whole "
         "number >= -1"),
    ],
)  # fmt: skip
def test_bad_schedules_are_one_line_naming_the_key(name: str, params: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError) as info:
        check_schedule(name, params, "ds.json")
    msg = str(info.value)
    assert msg.startswith("ds.json: ") and needle in msg and "\n" not in msg, msg


def test_the_config_table_is_each_schedule_class_s_signature() -> None:
    """config/schedules.py declares the parameters config validation accepts; the engine's classes must take exactly
    those, with those defaults, in that order (the order the "valid: ..." lists give)."""
    assert list(SCHEDULE_PARAMS) == list(SCHEDULES)
    for name, cls in SCHEDULES.items():
        signature = inspect.signature(cls.__init__).parameters.values()
        taken = [(p.name, REQUIRED if p.default is p.empty else p.default) for p in signature]
        assert taken[:2] == [("self", REQUIRED), ("optimizer", REQUIRED)], name
        assert taken[2:] == list(SCHEDULE_PARAMS[name].items()), name


def test_every_declared_default_passes_its_own_check() -> None:
    needed = {"total_num_steps": 10, "cycle_min_lr": 0.1, "cycle_max_lr": 1.0}  # the required ones, valid values
    for name, declared in SCHEDULE_PARAMS.items():
        params = {k: needed[k] if d is REQUIRED else d for k, d in declared.items()}
        check_schedule(name, params, "ds.json")  # a parameter without a kind, or a default out of it, raises


def test_whole_numbers_reach_the_schedules_as_ints() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build_schedule(opt, "OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_stair_count": 2.0})
    assert isinstance(sched, SCHEDULES["OneCycle"]) and sched.stairs == (2, 2)
    assert all(type(s) is int for s in sched.stairs)


def test_a_list_of_learning_rates_needs_one_per_group() -> None:
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))]}], lr=0.1)
    with pytest.raises(UsageError, match=r"scheduler.params.warmup_min_lr: 2 values for 1 parameter groups"):
        build_schedule(opt, "WarmupLR", {"warmup_min_lr": [0.0, 0.1]})


DS = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_deepspeed_and_native_configs_carry_the_scheduler_section(tmp_path: Path) -> None:
    sched = {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 10}}
    assert load_config({**DS, "scheduler": sched}, world_size=1).scheduler.params == sched["params"]
    native = tmp_path / "train.yaml"
    native.write_text("scheduler:\n  type: WarmupCosineLR\n  params: {total_num_steps: 100, warmup_type: linear}\n")
    cfg = load_config(native, world_size=1)
    assert cfg.scheduler.type == "WarmupCosineLR" and cfg.scheduler.params["warmup_type"] == "linear"
    assert load_config({**DS, "scheduler": {"params": {}}}, world_size=1).scheduler.type is None  # DeepSpeed: none
    assert load_config({}, world_size=1).scheduler.type is None


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({**DS, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, "<dict>: WarmupDecayLR needs "
         "scheduler.params.total_num_steps"),
        ({"scheduler": {"params": {"warmup_num_steps": 3}}}, "<dict>: scheduler.params is set without scheduler.type"),
        ({**DS, "scheduler": {"type": "WarmupLR", "params": [1]}}, "scheduler.params must be a mapping"),
        ({"scheduler": {"type": "OneCycle", "parms": {}}}, "unknown key 'scheduler.parms'; did you mean "
         "'scheduler.params'?"),
    ],
)  # fmt: skip
def test_config_scheduler_errors(cfg: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError) as info:
        load_config(cfg, world_size=1)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------------ the engine's step
@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 2])
def test_pieces_step_the_schedule_after_each_applied_step_only(world1: None, stage: int) -> None:
    """fp16 with loss scaling; steps 2 and 5 overflow (an infinite loss) and are skipped. DeepSpeed's engine steps its
    scheduler after every optimizer step it takes and not after an overflow: the applied steps run at DeepSpeed's
    sequence without gaps, and a skipped step leaves the learning rate where it was."""
    case = CASES["decay_log"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}  # 2^8: no overflow but the two made here
    ds = {**DS, "zero_optimization": {"stage": stage}, "fp16": fp16,
          "scheduler": {"type": case["type"], "params": case["params"]}}  # fmt: skip
    pieces = build_pieces(model, ds)
    assert pieces.scheduler is not None and pieces.stateful(model)["scheduler"] is pieces.scheduler
    net, gen = pieces.wrap(model), torch.Generator().manual_seed(1)
    applied, skipped = [], []
    for step in range(14):
        lr = pieces.optimizer.param_groups[0]["lr"]
        x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)
        with pieces.autocast():
            loss = (net(x).float() - y).square().mean()
        pieces.backward(loss * float("inf") if step in (2, 5) else loss)
        result = pieces.step()
        (skipped if result.skipped else applied).append((step, lr))
        if result.skipped:
            assert pieces.optimizer.param_groups[0]["lr"] == lr
    assert [s for s, _ in skipped] == [2, 5]
    assert [lr for _, lr in applied] == [lrs[0] for lrs in case["lrs"][: len(applied)]]
    assert pieces.scheduler.last_batch_iteration == len(applied) - 1
