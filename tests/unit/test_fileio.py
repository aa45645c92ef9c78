"""fileio.write_atomic: the one rule for replacing a file (bytes, text, or a writer function)."""

from __future__ import annotations

import pytest

from elasticzero.fileio import write_atomic


def test_bytes_text_and_writer_function(tmp_path):
    target = tmp_path / "f"
    write_atomic(target, b"\x00\xff")
    assert target.read_bytes() == b"\x00\xff"
    write_atomic(target, "text", durable=False)
    assert target.read_text() == "text"
    write_atomic(target, lambda fh: fh.write(b"streamed"))
    assert target.read_bytes() == b"streamed"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_failing_writer_leaves_old_file_and_no_temp(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def boom(fh):
        fh.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, boom)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
