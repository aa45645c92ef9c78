"""Which device and backend a worker uses (``elasticzero.device``): the decision over facts, and its I/O on the CPU.

No GPU here: :func:`placement` is pure, so the CUDA cases are decided from facts (``cuda_available``,
``device_count``, the launcher's ``LOCAL_RANK``); only the CPU case is run for real (a world of one over gloo).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elasticzero.device import COLLECTIVE_TIMEOUT_ENV, Facts, Placement, init_distributed, placement
from elasticzero.errors import UsageError

LAUNCHED = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}


def test_no_cuda_is_cpu_over_gloo() -> None:
    assert placement(Facts(False, 0, LAUNCHED)) == Placement("cpu", "gloo", alone=False)


def test_cuda_available_without_devices_is_cpu() -> None:
    assert placement(Facts(True, 0, LAUNCHED)).device == "cpu"


def test_cuda_is_the_local_rank_device_over_nccl() -> None:
    where = placement(Facts(True, 2, LAUNCHED))
    assert (where.device, where.backend, where.bound_device) == ("cuda:1", "nccl", "cuda:1")


def test_cpu_group_is_not_bound_to_a_device() -> None:
    assert placement(Facts(False, 0, LAUNCHED)).bound_device is None


def test_run_directly_is_alone_on_device_zero() -> None:
    assert placement(Facts(True, 1, {})) == Placement("cuda:0", "nccl", alone=True)
    assert placement(Facts(False, 0, {"LOCAL_RANK": "0"})).alone


def test_local_rank_beyond_the_visible_devices_is_refused() -> None:
    env = {**LAUNCHED, "LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "4,5"}
    with pytest.raises(UsageError, match=r"LOCAL_RANK=2 but this process sees 2 CUDA device\(s\) "
                       r"\(CUDA_VISIBLE_DEVICES=4,5\): start at most 2 workers per node"):  # fmt: skip
        placement(Facts(True, 2, env))


@pytest.mark.parametrize("bad", ["-1", "x", "", "\u0661"])
def test_local_rank_not_an_index_is_refused(bad: str) -> None:
    with pytest.raises(UsageError, match="is not a device index"):
        placement(Facts(True, 2, {**LAUNCHED, "LOCAL_RANK": bad}))


def test_local_rank_is_not_read_without_cuda() -> None:
    assert placement(Facts(False, 0, {**LAUNCHED, "LOCAL_RANK": "x"})).device == "cpu"


def test_init_distributed_on_the_cpu_is_a_world_of_one_over_gloo() -> None:
    assert not dist.is_initialized()
    device = init_distributed(Facts(False, 0, {}))
    try:
        assert device == torch.device("cpu")
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("gloo", 1, 0)
        t = torch.ones(2, device=device)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_the_example_uses_the_library_rule() -> None:
    """One rule: no example or bench decides the backend itself (``init_process_group("nccl"`` or a cuda check)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for script in sorted((root / "examples").glob("*.py")):
        text = script.read_text()
        assert "init_process_group" not in text and "is_available()" not in text, script


def test_the_launchers_timeout_is_the_groups_timeout() -> None:
    from datetime import timedelta

    seconds = 7.5
    assert placement(Facts(False, 0, {COLLECTIVE_TIMEOUT_ENV: str(seconds)})).timeout == timedelta(seconds=seconds)
    init_distributed(Facts(False, 0, {COLLECTIVE_TIMEOUT_ENV: str(seconds)}))
    try:
        assert _group_timeout() == timedelta(seconds=seconds)
    finally:
        dist.destroy_process_group()


def test_an_explicit_timeout_wins_over_the_launchers() -> None:
    from datetime import timedelta

    mine = timedelta(seconds=11)
    init_distributed(Facts(False, 0, {COLLECTIVE_TIMEOUT_ENV: "7"}), timeout=mine)
    try:
        assert _group_timeout() == mine
    finally:
        dist.destroy_process_group()


def test_no_launcher_timeout_keeps_torchs_default() -> None:
    from torch.distributed.constants import default_pg_timeout

    assert placement(Facts(False, 0, {})).timeout is None
    init_distributed(Facts(False, 0, {}))
    try:
        assert _group_timeout() == default_pg_timeout
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "later"])
def test_a_bad_launcher_timeout_is_refused_before_any_group(bad: str) -> None:
    with pytest.raises(UsageError, match=f"{COLLECTIVE_TIMEOUT_ENV}="):
        placement(Facts(False, 0, {COLLECTIVE_TIMEOUT_ENV: bad}))
    assert not dist.is_initialized()


def _group_timeout() -> object:
    """The default group's gloo backend timeout (torch keeps it in the backend's options)."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
