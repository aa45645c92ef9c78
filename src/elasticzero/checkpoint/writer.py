"""``ChecksummingFileSystemWriter``: torch's ``FileSystemWriter`` that computes each file's size and checksum
(:mod:`~elasticzero.checkpoint.digest`) while writing it, so the manifest needs no second read of the checkpoint.

The bytes and the file layout are exactly ``FileSystemWriter``'s (a plain ``dcp.load`` with torch's
``FileSystemReader`` reads the result): only the stream DCP writes into is wrapped, through the public
``FileSystem.create_stream`` extension point. The hash releases the GIL on large buffers, and the tensor bytes pass
through it once, while they are in cache on their way to the file.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from elasticzero.checkpoint import digest


class DigestStream(io.RawIOBase):
    """A write-only file that keeps the running checksum and byte count of what goes through it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.hasher = digest.Hasher()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        self.hasher.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


class _DigestFileSystem(FileSystem):
    """``FileSystem`` whose write streams record ``{file name: manifest entry}`` (renames carry the record)."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP may write several files from its own threads (thread_count > 1)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as raw:
            stream = DigestStream(raw)
            yield stream
            if not stream.closed:
                stream.flush()
        with self._lock:
            self.files[Path(path).name] = digest.record(stream.size, stream.hasher)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.files:
                self.files[Path(new_path).name] = self.files.pop(Path(path).name)


class ChecksummingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` (same arguments) whose :attr:`files` gives, after ``dcp.save``, the manifest entry (size
    and checksum) of every file this rank wrote (rank 0's include ``.metadata``)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = self._digests = _DigestFileSystem()

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return dict(self._digests.files)
