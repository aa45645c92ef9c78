"""Slot/core binding and worker environment construction (pure)."""

from __future__ import annotations

import pytest

from elasticzero.agent.binding import (
    CPUS_ENV,
    JOB_ID_ENV,
    SHIM_STUB,
    agent_env,
    cores_for_worker,
    format_cpus_table,
    parse_cpus_table,
    shim_argv,
    split_cores,
    visible_devices,
    worker_extra_env,
)


def test_visible_devices_keeps_table_order() -> None:
    assert visible_devices((3, 1, 2)) == "3,1,2"


def test_split_cores_even_and_leftover() -> None:
    assert split_cores([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_cores([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7]]  # core 8 unused, like DeepSpeed
    assert split_cores([1], 3) == [[1], [1], [1]]  # fewer cores than ranks: shared
    with pytest.raises(ValueError):
        split_cores([], 1)
    with pytest.raises(ValueError):
        split_cores([0], 0)


def test_cpus_table_round_trip() -> None:
    chunks = [[0, 1], [2, 3]]
    assert parse_cpus_table(format_cpus_table(chunks)) == chunks


def test_agent_env() -> None:
    env = agent_env("job-7", (0, 2), [[0], [1]])
    assert env[JOB_ID_ENV] == "job-7"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert env[CPUS_ENV] == "0;1"
    bare = agent_env("j", None, None)
    assert "CUDA_VISIBLE_DEVICES" not in bare and CPUS_ENV not in bare


def test_worker_extra_env_from_torch_env() -> None:
    torch_env = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "LOCAL_RANK": "1"}
    assert worker_extra_env(torch_env) == {"LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "3"}
    bound = {**torch_env, CPUS_ENV: "0,1;2,3"}
    assert cores_for_worker(bound) == [2, 3]
    assert worker_extra_env(bound)["OMP_NUM_THREADS"] == "2"
    assert cores_for_worker(torch_env) is None


def test_shim_argv_passes_command_untouched() -> None:
    exe, args = shim_argv("/py", "/py", ["-u", "train.py", "a;echo x", "$(y)"], "/site")
    assert exe == "/py"
    assert args == ["-S", "-c", SHIM_STUB, "/site", "--", "/py", "-u", "train.py", "a;echo x", "$(y)"]
