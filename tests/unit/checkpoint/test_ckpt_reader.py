"""FastFileSystemReader (checkpoint/reader.py) in one process, no process group: bit-exact against torch's reader
for every dtype and shape DCP writes (fast path and per-item fallbacks), one clear error naming the file for damaged
zip records, and the pure parsers (byte ranges of narrows, a data.pkl that is not one plain tensor)."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from elasticzero.checkpoint.planner import SafeFileSystemReader, ZeroLoadPlanner, ZeroSavePlanner, read_metadata_file
from elasticzero.checkpoint.reader import (
    FastFileSystemReader,
    PickledTensor,
    Unsupported,
    byte_range,
    pickled_tensor,
)
from elasticzero.checkpoint.snapshot import fresh_like, tensors_of
from elasticzero.engine.zero.layout import FlatChunk
from elasticzero.errors import UsageError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1000, generator=g)
    return {
        "master": FlatChunk(full[100:700].clone(), 100, 1000),
        "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(33, generator=g).half(),
        "ids": torch.arange(-5, 12, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(4, 6, generator=g).t(),  # saved with its strides: torch's path reads it
        "plain": {"step": 7, "name": "x"},
    }


def _save(tmp_path: Path) -> Path:
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "c"), planner=ZeroSavePlanner(), no_dist=True)
    return tmp_path / "c"


def _template() -> dict[str, Any]:
    t = fresh_like(_state())
    t["master"] = FlatChunk(torch.empty(450), 250, 1000)  # another range (another world size)
    t["plain"] = {"step": 0, "name": ""}
    return t


def _load(reader: Any, d: Path, template: dict[str, Any]) -> dict[str, Any]:
    dcp.load(template, storage_reader=reader(d), planner=ZeroLoadPlanner(), no_dist=True)
    return template


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def test_fast_reader_is_bit_exact_and_reads_directly(tmp_path: Path) -> None:
    d = _save(tmp_path)
    want = _load(SafeFileSystemReader, d, _template())
    reader = FastFileSystemReader(d)
    got = _template()
    got["fp16"] = torch.empty(66).half()[::2]  # a strided destination: torch's path for this item
    dcp.load(got, storage_reader=reader, planner=ZeroLoadPlanner(), no_dist=True)
    assert got["plain"] == {"step": 7, "name": "x"} == want["plain"]
    pairs = list(zip(tensors_of(want), tensors_of(got), strict=True))
    assert len(pairs) == 8
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    assert torch.equal(got["master"].tensor, _state()["master"].tensor[150:600])
    assert reader.slow_items == 2  # the transposed tensor and the strided destination


def _item_zip(d: Path, fqn: str) -> tuple[Path, int, int]:
    md = read_metadata_file(str(d / ".metadata"))
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    return d / info.relative_path, info.offset, info.length


def _central_entry(item: bytes, name: bytes) -> int:
    """Offset of ``name``'s central directory entry in an item (the directory is at the item's end)."""
    at = item.rindex(b"PK\x05\x06")
    while item[at + 46 : at + 46 + len(name)] != name:
        at = item.rindex(b"PK\x01\x02", 0, at)
    return at


def _damage(path: Path, offset: int, length: int, case: str) -> None:
    blob = bytearray(path.read_bytes())
    item = blob[offset : offset + length]
    if case == "truncated":
        blob = blob[: offset + length // 2]
    elif case == "local_header":
        at = item.index(b"PK\x03\x04", item.index(b"archive/byteorder") + 17)  # the next local header: data/0
        blob[offset + at : offset + at + 4] = b"XXXX"
    else:
        ce = offset + _central_entry(bytes(item), b"archive/data/0")
        if case == "method":
            blob[ce + 10 : ce + 12] = struct.pack("<H", 8)
        else:  # size
            blob[ce + 20 : ce + 28] = struct.pack("<II", 64, 64)
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("truncated", "the file ends after"),
        ("local_header", "bad zip local header of archive/data/0"),
        ("method", "zip record archive/data/0 is compressed (method 8)"),
        ("size", "storage record of 64 bytes, 600 x 4 expected"),
    ],
)
def test_damaged_item_is_one_error_naming_the_file(tmp_path: Path, case: str, needle: str) -> None:
    d = _save(tmp_path)
    path, offset, length = _item_zip(d, "master")
    _damage(path, offset, length, case)
    with pytest.raises(CheckpointException) as info:
        _load(FastFileSystemReader, d, _template())
    (err,) = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert isinstance(err, UsageError), err
    assert str(err).startswith(f"{path}: not a DCP data file as its metadata says"), err
    assert needle in str(err), err


def _pt(size: tuple[int, ...], stride: tuple[int, ...], storage_offset: int = 0) -> PickledTensor:
    numel = storage_offset + max(1, sum((s - 1) * st for s, st in zip(size, stride, strict=True)) + 1)
    return PickledTensor("0", torch.float32, numel, storage_offset, size, stride)


def test_byte_range_only_for_one_contiguous_range() -> None:
    rows = _pt((4, 3), (3, 1), storage_offset=2)
    assert byte_range(rows, (1, 0), (2, 3)) == ((2 + 3) * 4, 6 * 4)  # whole rows: one range
    assert byte_range(_pt((), ()), (), ()) == (0, 4)
    with pytest.raises(Unsupported, match="contiguous range"):
        byte_range(rows, (0, 1), (4, 2))  # a column slice
    with pytest.raises(Unsupported, match="not contiguous"):
        byte_range(_pt((3, 4), (1, 3)), (0, 0), (3, 4))  # transposed


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


def test_data_pkl_other_than_a_plain_tensor_is_not_unpickled() -> None:
    with pytest.raises(Unsupported, match=r"posix\.system"):
        pickled_tensor(pickle.dumps(_Evil(), protocol=2))
    with pytest.raises(Unsupported, match="not a tensor"):
        pickled_tensor(pickle.dumps([1, 2], protocol=2))
