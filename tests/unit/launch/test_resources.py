"""Resource discovery: explicit hostfile, $ELASTICZERO_HOSTFILE, default path, Slurm allocation, localhost."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.resources import discover, local_pool, slurm_pool


def _no_gpus() -> int:
    return 0


def _gpus_never_asked() -> int:
    raise AssertionError("GPU detection must not run when a hostfile or allocation decides")


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    f = tmp_path / "hostfile"
    f.write_text("a slots=2\nb slots=1\n")
    return f


def test_explicit_hostfile(hostfile: Path, tmp_path: Path) -> None:
    d = discover(str(hostfile), {}, None, _gpus_never_asked, str(tmp_path / "none"))
    assert (d.kind, d.pool) == ("hostfile", {"a": (0, 1), "b": (0,)})


def test_explicit_missing_hostfile_never_falls_back(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        discover(str(tmp_path / "missing"), {}, None, _gpus_never_asked, str(tmp_path / "none"))


def test_env_hostfile_is_explicit_too(hostfile: Path, tmp_path: Path) -> None:
    assert discover(None, {"ELASTICZERO_HOSTFILE": str(hostfile)}, None, _gpus_never_asked).kind == "hostfile"
    with pytest.raises(UsageError, match="not found"):
        discover(None, {"ELASTICZERO_HOSTFILE": str(tmp_path / "x")}, None, _gpus_never_asked)


def test_default_path_used_when_present(hostfile: Path) -> None:
    d = discover(None, {"SLURM_JOB_NODELIST": "n[1-2]"}, None, _gpus_never_asked, str(hostfile))
    assert d.kind == "hostfile"
    assert d.source == f"hostfile {hostfile}"


def test_no_hostfile_means_localhost_with_nproc(tmp_path: Path) -> None:
    d = discover(None, {}, 3, _no_gpus, str(tmp_path / "none"))
    assert (d.kind, d.pool) == ("local", {"localhost": (0, 1, 2)})
    assert discover(None, {}, None, _no_gpus, str(tmp_path / "none")).pool == {"localhost": (0,)}


def test_slurm_allocation_used_without_hostfile(tmp_path: Path) -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[01-02],cpu7", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    d = discover(None, env, None, _gpus_never_asked, str(tmp_path / "none"))
    assert (d.kind, d.pool) == ("slurm", {"gpu01": (0, 1), "gpu02": (0, 1), "cpu7": (0,)})


def test_local_gpus_and_cuda_visible_devices() -> None:
    assert local_pool({}, 2, None) == {"localhost": (0, 1)}
    assert local_pool({"CUDA_VISIBLE_DEVICES": "3,5"}, 2, None) == {"localhost": (3, 5)}
    # torch counts what CUDA_VISIBLE_DEVICES shows; the ids are the slots the agent binds
    assert local_pool({"CUDA_VISIBLE_DEVICES": "6,1,4"}, 2, None) == {"localhost": (6, 1)}


@pytest.mark.parametrize("visible", ["GPU-1a2b", "MIG-3", "0,²"])
def test_local_gpu_uuids_are_rejected(visible: str) -> None:
    with pytest.raises(UsageError, match=rf"^CUDA_VISIBLE_DEVICES='{visible}' lists non-numeric devices"):
        local_pool({"CUDA_VISIBLE_DEVICES": visible}, 2, None)


def test_local_cpu_nproc_must_be_positive() -> None:
    with pytest.raises(UsageError, match="must be at least 1"):
        local_pool({}, 0, 0)


@pytest.mark.parametrize(
    ("env", "nproc", "pool"),
    [
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "4"}, None, {"n1": (0, 1, 2, 3), "n2": (0, 1, 2, 3)}),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "2"}, 1, {"n1": (0, 1), "n2": (0, 1)}),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}, 3, {"n1": (0, 1, 2), "n2": (0, 1, 2)}),
        ({"SLURM_NODELIST": "n1"}, None, {"n1": (0,)}),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "0", "SLURM_TASKS_PER_NODE": "2"}, None, {"n1": (0, 1)}),
    ],
)
def test_slurm_slots(env: dict[str, str], nproc: int | None, pool: dict[str, tuple[int, ...]]) -> None:
    assert slurm_pool(env, nproc) == pool


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2"}, "gives 1 counts for 2 nodes"),
        ({"SLURM_JOB_NODELIST": "n1,n1"}, "node 'n1' listed twice"),
        ({"SLURM_JOB_NODELIST": "n1,N1"}, "node 'N1' listed twice"),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "x"}, "SLURM_GPUS_ON_NODE='x' is not a number"),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "0"}, "has a zero count"),
    ],
)
def test_slurm_errors(env: dict[str, str], words: str) -> None:
    with pytest.raises(UsageError) as err:
        slurm_pool(env, None)
    assert words in str(err.value)
