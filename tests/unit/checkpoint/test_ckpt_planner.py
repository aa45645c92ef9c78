"""FlatChunk through DCP in one process (world-size-1 gloo group): element ranges written at their offsets, read
back into other ranges (what a new world size asks for); the metadata reader refuses foreign pickles; the
snapshot is a copy."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from elasticzero.checkpoint.planner import SafeFileSystemReader, ZeroLoadPlanner, ZeroSavePlanner, read_metadata_file
from elasticzero.checkpoint.snapshot import Stager, fresh_like
from elasticzero.engine.zero.layout import FlatChunk
from elasticzero.errors import UsageError
from ez_testing import free_port


@pytest.fixture(scope="module")
def world1() -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_chunks_reshard_in_one_process(world1: Any, tmp_path: Path) -> None:
    full = torch.arange(10, dtype=torch.float32)
    # saved: elements [3, 10) of "a" and [0, 4) of "b"; read back: other ranges (what another world size asks for)
    sd = {"a": FlatChunk(full[3:10].clone(), 3, 10), "b": FlatChunk(full[0:4].clone(), 0, 4), "n": {"k": 5}}
    # "a" is only partly covered: DCP checks coverage only when several ranks save
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "c1"), planner=ZeroSavePlanner())
    md = read_metadata_file(str(tmp_path / "c1" / ".metadata"))
    assert tuple(md.state_dict_metadata["a"].size) == (10,)
    assert [tuple(c.offsets) for c in md.state_dict_metadata["a"].chunks] == [(3,)]
    into = {"a": FlatChunk(torch.zeros(5), 4, 10), "b": FlatChunk(torch.zeros(2), 1, 4), "n": {"k": 0}}
    dcp.load(into, storage_reader=SafeFileSystemReader(tmp_path / "c1"), planner=ZeroLoadPlanner())
    assert torch.equal(into["a"].tensor, full[4:9]) and torch.equal(into["b"].tensor, full[1:3])
    assert into["n"] == {"k": 5}
    wrong = {"a": FlatChunk(torch.zeros(5), 0, 11)}
    with pytest.raises(BaseException, match=r"shape \(10,\) in the checkpoint, \(11,\) here"):
        dcp.load(wrong, storage_reader=SafeFileSystemReader(tmp_path / "c1"), planner=ZeroLoadPlanner())


def test_flatchunk_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="inside"):
        FlatChunk(torch.zeros(3), 8, 10)
    with pytest.raises(ValueError, match="1-D"):
        FlatChunk(torch.zeros(2, 2), 0, 10)


class _Boom:
    def __reduce__(self) -> Any:
        return (os.getcwd, ())


def test_metadata_reader_refuses_foreign_pickles(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(UsageError, match=r"refusing to import posix\.getcwd"):
        read_metadata_file(str(path))
    path.write_bytes(b"\x80\x04\x95")  # truncated
    with pytest.raises(UsageError, match="not a readable DCP metadata file"):
        read_metadata_file(str(path))
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UsageError, match="holds dict"):
        read_metadata_file(str(path))


def test_snapshot_is_a_copy_and_reuses_buffers() -> None:
    live = {"w": torch.ones(3), "c": FlatChunk(torch.ones(2), 1, 3), "meta": {"pos": [1, 2]}}
    stager = Stager()
    snap = stager.stage(7, {"x": live})
    live["w"].add_(5)
    live["c"].tensor.add_(5)
    live["meta"]["pos"].append(3)
    assert torch.equal(snap.state["x"]["w"], torch.ones(3)) and torch.equal(snap.state["x"]["c"].tensor, torch.ones(2))
    assert snap.state["x"]["meta"] == {"pos": [1, 2]} and snap.nbytes == 20
    again = stager.stage(8, {"x": live})
    assert again.state["x"]["w"] is snap.state["x"]["w"]  # same staging buffer (the previous save has finished)
    fresh = fresh_like(live)
    assert fresh["w"] is not live["w"] and fresh["c"].offset == 1 and fresh["meta"] == live["meta"]
