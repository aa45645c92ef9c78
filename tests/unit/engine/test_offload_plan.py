"""ZeRO-Offload's decisions (engine/zero/offload.py): the budget planner on tables, each bucket's home from the
device the placement rule of elasticzero.device picks, and the rule for stepping during backward."""

from __future__ import annotations

import pytest

from elasticzero.device import Facts, placement
from elasticzero.engine.zero.offload import (
    BucketHome,
    OffloadOptions,
    budget_for,
    check_stage,
    early_step_blocker,
    plan_homes,
    plan_offload,
)
from elasticzero.errors import UsageError

GPU_WORKER = Facts(cuda_available=True, device_count=8, env={"RANK": "11", "LOCAL_RANK": "3"})
CPU_WORKER = Facts(cuda_available=False, device_count=0, env={"RANK": "1", "LOCAL_RANK": "1"})


@pytest.mark.parametrize(
    ("sizes", "budget", "want"),
    [
        ([10, 30, 20], 60, (False, False, False)),  # fits: nothing moves
        ([10, 30, 20], 59, (False, True, False)),  # the largest goes first
        ([10, 30, 20], 30, (False, True, False)),  # exactly at the budget is fitting
        ([10, 30, 20], 29, (False, True, True)),  # then the next largest
        ([10, 30, 20], 0, (True, True, True)),  # a zero budget offloads everything
        ([20, 20, 20], 40, (True, False, False)),  # ties: the lower bucket index first
        ([20, 20, 20], 20, (True, True, False)),
        ([], 0, ()),
        ([0, 5], 0, (False, True)),  # an empty bucket needs no room
    ],
)
def test_plan_offload_largest_first_until_it_fits(sizes: list[int], budget: int, want: tuple[bool, ...]) -> None:
    got = plan_offload(sizes, budget)
    assert got == want
    assert sum(s for s, away in zip(sizes, got, strict=True) if not away) <= budget


def test_plan_offload_refuses_a_negative_budget() -> None:
    with pytest.raises(UsageError, match=">= 0 bytes"):
        plan_offload([1], -1)


@pytest.mark.parametrize(
    ("options", "want"),
    [
        (OffloadOptions(optimizer=True), 0),  # ratio 1: everything leaves
        (OffloadOptions(optimizer=True, ratio=0.0), 100),
        (OffloadOptions(optimizer=True, ratio=0.25), 75),
        (OffloadOptions(optimizer=True, ratio=0.25, device_budget_bytes=10), 10),  # the byte budget wins
    ],
)
def test_budget_for(options: OffloadOptions, want: int) -> None:
    assert budget_for(options, [40, 60]) == want


def test_ratio_offloads_the_largest_share_first() -> None:
    """DeepSpeed's ratio 0.5 over buckets of 10/50/40 bytes: 50 leaves, 50 stay."""
    plan = plan_homes(OffloadOptions(optimizer=True, ratio=0.5), "cuda:0", [10, 50, 40])
    assert [h.host for h in plan.homes] == [False, True, False]


def test_homes_on_a_gpu_worker_are_pinned_host_buffers_copied_on_a_side_stream() -> None:
    device = placement(GPU_WORKER).device
    assert device == "cuda:3"
    plan = plan_homes(OffloadOptions(optimizer=True), device, [8, 8])
    assert plan.homes == (BucketHome(host=True, copies=True, pinned=True, side_stream=True),) * 2
    assert plan.side_stream and plan.any_host and plan.offloaded() == [0, 1]


def test_pageable_memory_when_pinning_is_off() -> None:
    plan = plan_homes(OffloadOptions(optimizer=True, pin_memory=False), placement(GPU_WORKER).device, [8])
    assert plan.homes[0].host and not plan.homes[0].pinned and plan.homes[0].side_stream


def test_stage3_param_offload_gathers_from_the_host() -> None:
    plan = plan_homes(OffloadOptions(optimizer=True, params=True), placement(GPU_WORKER).device, [8])
    assert plan.homes[0].params_on_host


def test_on_a_cpu_worker_offload_is_the_identity() -> None:
    device = placement(CPU_WORKER).device
    assert device == "cpu"
    plan = plan_homes(OffloadOptions(optimizer=True, params=True), device, [8, 8])
    assert not plan.any_host and not plan.side_stream
    assert plan.homes == (BucketHome(),) * 2


def test_cpu_copies_take_the_host_path_without_streams_or_pinning() -> None:
    plan = plan_homes(OffloadOptions(optimizer=True, cpu_copies=True), placement(CPU_WORKER).device, [8])
    assert plan.homes[0] == BucketHome(host=True, copies=True, pinned=False, side_stream=False)


def test_no_options_keep_everything_resident() -> None:
    assert not plan_homes(None, "cuda:0", [1, 2]).any_host
    assert not plan_homes(OffloadOptions(), "cuda:0", [1, 2]).any_host


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": True, "ratio": 1.5}, "ratio must be in"),
        ({"optimizer": True, "device_budget_bytes": -1}, "device_budget_bytes must be >= 0"),
        ({"params": True}, "needs zero.offload.optimizer"),
    ],
)
def test_options_refuse_bad_values_in_one_line(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match) as err:
        OffloadOptions(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_param_offload_is_stage3_only() -> None:
    options = OffloadOptions(optimizer=True, params=True)
    check_stage(options, 3)
    check_stage(OffloadOptions(optimizer=True), 1)
    for stage in (1, 2):
        with pytest.raises(UsageError, match="stage 3 only"):
            check_stage(options, stage)


@pytest.mark.parametrize(
    ("armed", "clipping", "loss_scaling", "watched", "blocked_by"),
    [
        (True, False, False, False, None),
        (False, False, False, False, "not the backward that ends"),
        (True, True, False, False, "clipping"),
        (True, False, True, False, "overflow"),
        (True, False, False, True, "watched"),
    ],
)
def test_early_step_rule(
    armed: bool, clipping: bool, loss_scaling: bool, watched: bool, blocked_by: str | None
) -> None:
    reason = early_step_blocker(armed=armed, clipping=clipping, loss_scaling=loss_scaling, watched=watched)
    assert reason is None if blocked_by is None else blocked_by in (reason or "")
