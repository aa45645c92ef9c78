"""One rule for replacing a file so that readers see the old bytes or the new ones, never a torn mix.

Write a uniquely named temporary file beside the target, flush and ``fsync`` it, ``os.replace`` it into place, then
``fsync`` the directory so the rename survives a crash. Several writers may race (ranks caching the same corpus):
each renames whole bytes into place. Standard library only: trial scripts of any framework import it through
``elasticzero.autotune.report``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["fsync_dir", "write_atomic"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a directory (makes a rename or an unlink inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], object], *, durable: bool = True
) -> Path:
    """Replace ``path`` with ``data`` atomically; ``durable`` fsyncs the file and its directory. Returns the path.

    ``data`` may be a function writing into the open binary file (e.g. ``lambda fh: torch.save(sd, fh)``), so large
    payloads are streamed instead of built in memory first."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)
    return target
