"""checkpoint/digest.py: the one rule for file checksums — XXH3-64 written, CRC-32 (format 1) still checked, any
buffer shape hashed the same, and a manifest entry without a known checksum is a named problem, not a pass."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import xxhash

from elasticzero.checkpoint import commit, digest


def test_streamed_equals_whole_and_tensor_memory_hashes_like_bytes(tmp_path: Path) -> None:
    data = torch.arange(3 << 20, dtype=torch.uint8).numpy().tobytes()  # 3 MiB: a partial last 4 MiB block
    for algorithm, whole in (("xxh3_64", xxhash.xxh3_64(data).hexdigest()), ("crc32", zlib.crc32(data))):
        h = digest.Hasher(algorithm)
        view = memoryview(data)
        for at in range(0, len(data), 1000003):
            h.update(view[at : at + 1000003])
        assert h.value() == whole, algorithm
        (tmp_path / algorithm).write_bytes(data)
        assert digest.of_file(tmp_path / algorithm, algorithm) == whole
    t = torch.randn(1000)
    h = digest.Hasher()
    h.update(memoryview(t.numpy()).cast("B"))  # a writable buffer, as the writer hands over tensor bytes
    assert h.value() == xxhash.xxh3_64(t.numpy().tobytes()).hexdigest()
    assert digest.record(4000, h) == {"size": 4000, "xxh3_64": h.value()}


def test_mismatch_checks_the_recorded_algorithm(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"checkpoint bytes")
    assert digest.mismatch(path, {"size": 16, "xxh3_64": digest.of_file(path)}) is None
    assert digest.mismatch(path, {"size": 16, "crc32": zlib.crc32(b"checkpoint bytes")}) is None  # format 1
    assert "checksum (crc32) differs from the manifest (corrupt)" in str(digest.mismatch(path, {"crc32": 1}))
    assert "checksum (xxh3_64) differs" in str(digest.mismatch(path, {"xxh3_64": "0" * 16}))
    assert "records no checksum for it (expected one of xxh3_64, crc32)" in str(digest.mismatch(path, {"size": 16}))
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        digest.Hasher("md5")


def test_format_1_manifests_still_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "data").write_bytes(b"xy")
    v1 = {"format": 1, "step": 2, "world_size": 1, "files": {"data": {"size": 2, "crc32": zlib.crc32(b"xy")}}}
    assert commit.manifest_errors(v1, "m") == []
    assert commit.file_errors(tmp_path, v1["files"], ["data"], check_digest=True) == []
    (tmp_path / "data").write_bytes(b"xz")
    assert "checksum (crc32) differs" in commit.file_errors(tmp_path, v1["files"], ["data"], check_digest=True)[0]
    assert commit.FORMAT_VERSION == 2 and "reads 1, 2" in commit.manifest_errors({**v1, "format": 3}, "m")[0]
