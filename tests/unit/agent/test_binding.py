"""Slot/core binding and worker environment construction (pure)."""

from __future__ import annotations

import pytest

from elasticzero.agent.binding import (
    AGENT_PID_ENV,
    CPUS_ENV,
    JOB_ID_ENV,
    SHIM_STUB,
    cores_for_worker,
    format_cores,
    node_env,
    parse_cores,
    shim_argv,
    split_cores,
    visible_devices,
    worker_env,
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


def test_cores_round_trip() -> None:
    assert parse_cores(format_cores([2, 3])) == [2, 3]


def test_worker_env_per_local_rank() -> None:
    base = node_env("job-7", 4242)
    assert base == {JOB_ID_ENV: "job-7", AGENT_PID_ENV: "4242"}
    cpus = [[0, 1], [2, 3]]
    env = [worker_env(base, r, (0, 2), cpus, virtual_local_rank=False) for r in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["0,2", "0,2"]  # all the node's slots; LOCAL_RANK indexes
    assert [e[CPUS_ENV] for e in env] == ["0,1", "2,3"]
    assert all(e[JOB_ID_ENV] == "job-7" for e in env)
    virtual = [worker_env(base, r, (0, 2), None, virtual_local_rank=True) for r in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in virtual] == ["0", "2"]  # one device each, seen as device 0
    bare = worker_env(base, 0, None, None, virtual_local_rank=False)
    assert bare == base and bare is not base


def test_worker_extra_env_from_torch_env() -> None:
    torch_env = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "LOCAL_RANK": "1"}
    assert worker_extra_env(torch_env) == {"LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "3"}
    bound = {**torch_env, CPUS_ENV: "2,3"}
    assert cores_for_worker(bound) == [2, 3]
    assert worker_extra_env(bound)["OMP_NUM_THREADS"] == "2"
    assert cores_for_worker(torch_env) is None


def test_shim_argv_passes_command_untouched() -> None:
    exe, args = shim_argv("/py", "/py", ["-u", "train.py", "a;echo x", "$(y)"], "/site")
    assert exe == "/py"
    assert args == ["-S", "-c", SHIM_STUB, "/site", "--", "/py", "-u", "train.py", "a;echo x", "$(y)"]
