"""ChecksummingFileSystemWriter (checkpoint/writer.py) in one process, no process group: the sizes and checksums it
records while writing equal those of the files on disk, it records every file (``.metadata`` under its final name),
the files are plain DCP (torch's ``FileSystemReader`` loads them bit-exact), and the async writer thread's
``writer_priority`` lowers only that thread's priority (``SCHED_IDLE`` by default, or a niceness)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from elasticzero.checkpoint import Checkpointer, digest
from elasticzero.checkpoint.checkpointer import lower_priority
from elasticzero.checkpoint.planner import ZeroLoadPlanner, ZeroSavePlanner
from elasticzero.checkpoint.snapshot import fresh_like
from elasticzero.checkpoint.writer import ChecksummingFileSystemWriter
from elasticzero.engine.zero.layout import FlatChunk
from elasticzero.errors import UsageError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "master": FlatChunk(torch.randn(3000, generator=g)[500:2600].clone(), 500, 3000),
        "bf16": torch.randn(70, 5, generator=g).to(torch.bfloat16),
        "big": torch.randn(1 << 18, generator=g),  # 1 MiB: torch.save hands it over as one large buffer
        "plain": {"step": 7, "name": "x"},
    }


@pytest.mark.parametrize("thread_count", [1, 2])
def test_recorded_checksums_are_those_of_the_files_and_dcp_reads_them(tmp_path: Path, thread_count: int) -> None:
    writer = ChecksummingFileSystemWriter(tmp_path / "c", sync_files=False, thread_count=thread_count)
    dcp.save(_state(), storage_writer=writer, planner=ZeroSavePlanner(), no_dist=True)
    on_disk = {p.name for p in (tmp_path / "c").iterdir()}
    assert set(writer.files) == on_disk and ".metadata" in on_disk and len(on_disk) == 1 + thread_count
    for name, rec in writer.files.items():
        path = tmp_path / "c" / name
        assert rec == {"size": path.stat().st_size, "xxh3_64": digest.of_file(path)}, name
    template = fresh_like(_state())
    template["plain"] = {"step": 0, "name": ""}
    dcp.load(template, storage_reader=FileSystemReader(tmp_path / "c"), planner=ZeroLoadPlanner(), no_dist=True)
    want = _state()
    assert torch.equal(template["master"].tensor, want["master"].tensor)
    assert torch.equal(template["bf16"], want["bf16"]) and torch.equal(template["big"], want["big"])
    assert template["plain"] == {"step": 7, "name": "x"}


def _in_a_thread(fn: object) -> dict[str, int]:
    """Run ``fn()`` in a new thread; return that thread's scheduling policy and niceness, and the caller's after."""
    seen: dict[str, int] = {}

    def run() -> None:
        fn()  # type: ignore[operator]
        tid = threading.get_native_id()
        seen.update(policy=os.sched_getscheduler(tid), nice=os.getpriority(os.PRIO_PROCESS, tid))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    me = threading.get_native_id()
    seen.update(caller_policy=os.sched_getscheduler(me), caller_nice=os.getpriority(os.PRIO_PROCESS, me))
    return seen


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE per thread is Linux's")
def test_writer_priority_idle_puts_only_the_writer_thread_under_sched_idle() -> None:
    me = threading.get_native_id()
    before = (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me))
    seen = _in_a_thread(lambda: lower_priority("idle"))
    assert seen["policy"] == os.SCHED_IDLE
    assert (seen["caller_policy"], seen["caller_nice"]) == before


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is Linux's")
def test_writer_priority_niceness_lowers_only_the_writer_thread() -> None:
    me = threading.get_native_id()
    before = (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me))
    seen = _in_a_thread(lambda: lower_priority(19))
    assert (seen["policy"], seen["nice"]) == (os.SCHED_OTHER, 19)
    assert (seen["caller_policy"], seen["caller_nice"]) == before
    assert _in_a_thread(lambda: lower_priority(0))["nice"] == before[1]


@pytest.mark.parametrize("bad", [20, -1, "low", True, 1.5, None])
def test_a_bad_writer_priority_is_one_clear_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(UsageError, match=r"writer_priority must be 'idle' or a niceness 0\.\.19, got"):
        Checkpointer(tmp_path, async_save=True, writer_priority=bad)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())
