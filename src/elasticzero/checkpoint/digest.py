"""The checksum of every checkpoint file: one rule for computing, recording and checking it.

A manifest of format 2 records each file as ``{"size": n, "xxh3_64": "<16 hex digits>"}``; format 1 recorded
``"crc32"`` (zlib's CRC-32, an int), which is still checked when such a checkpoint is read. XXH3-64 because the
checksum is computed on both sides of a restart: by the background writer for every byte it writes, and by the load,
which reads every byte a second time for it while the restarted job waits. Here (AVX2) XXH3 hashes 8 GB/s out of
memory against zlib CRC-32's 1.8 GB/s (``bench/checkpoint_bench.py`` shows what that does to a load); both release
the GIL on large buffers. It detects corruption, not tampering.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"  # what new manifests record
KNOWN = ("xxh3_64", "crc32")  # what a manifest entry may carry (format 2, format 1)
_BLOCK = 1 << 20  # read into one reused buffer that stays in cache (4 MiB blocks: 20 % slower here; mmap: 40 %
# faster, but a file truncated under it would kill the process with SIGBUS instead of raising)


class Hasher:
    """Running checksum (``update`` with any contiguous buffer; ``value()`` as the manifest records it)."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        if algorithm not in KNOWN:
            raise ValueError(f"unknown checksum {algorithm!r} (known: {', '.join(KNOWN)})")
        self.algorithm = algorithm
        self._xxh = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> str | int:
        return self._xxh.hexdigest() if self._xxh is not None else self._crc


def record(size: int, hasher: Hasher) -> dict[str, Any]:
    """The manifest entry of a file of ``size`` bytes whose bytes went through ``hasher``."""
    return {"size": size, hasher.algorithm: hasher.value()}


def of_file(path: Path, algorithm: str = ALGORITHM) -> str | int:
    """The checksum of a whole file."""
    hasher, buf = Hasher(algorithm), bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.value()


def mismatch(path: Path, entry: Mapping[str, Any]) -> str | None:
    """Why ``path``'s bytes are not what the manifest ``entry`` says (None: they are)."""
    algorithm = next((a for a in KNOWN if a in entry), None)
    if algorithm is None:
        return f"{path}: the manifest records no checksum for it (expected one of {', '.join(KNOWN)})"
    if of_file(path, algorithm) != entry[algorithm]:
        return f"{path}: checksum ({algorithm}) differs from the manifest (corrupt)"
    return None
