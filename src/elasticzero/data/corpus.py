"""Real text every machine has without a download: the Python standard library's own source, as bytes.

:func:`stdlib_corpus` concatenates the ``.py`` files of ``sysconfig.get_paths()["stdlib"]`` (tests and
``site-packages`` left out) in sorted relative-path order, so every process with the same Python build gets the same
bytes; every ``eval_every``-th file goes to the eval split. The bytes are cached in ``cache_dir`` (written aside,
renamed into place; by default the user's cache directory, :func:`default_cache_dir`). :class:`ByteCorpus` cuts a
byte stream into non-overlapping ``(input, target)`` windows for a byte-level language model (vocabulary 256).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from elasticzero.errors import UsageError
from elasticzero.fileio import write_atomic

__all__ = ["ByteCorpus", "default_cache_dir", "stdlib_corpus", "stdlib_files"]

_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root`` (default: this interpreter's), sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = (p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/elasticzero``, else ``~/.cache/elasticzero`` (the XDG base directory rule)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "elasticzero"


def stdlib_corpus(
    cache_dir: str | Path | None = None, split: str = "train", *, eval_every: int = 20, max_bytes: int = 8 << 20
) -> torch.Tensor:
    """The ``split`` (``train`` or ``eval``) bytes as a uint8 tensor, at most ``max_bytes`` of them, cached in
    ``cache_dir`` (default :func:`default_cache_dir`)."""
    if split not in ("train", "eval"):
        raise UsageError(f"stdlib_corpus: split must be 'train' or 'eval', got {split!r}")
    root = sysconfig.get_paths()["stdlib"]  # one Python build's stdlib does not change: it keys the cache
    key = hashlib.sha256(repr((sys.version, root, split, eval_every, max_bytes)).encode())
    path = Path(cache_dir or default_cache_dir()) / f"stdlib-{split}-{key.hexdigest()[:16]}.bin"
    if not path.exists():
        files = [
            f for i, f in enumerate(stdlib_files(Path(root))) if (i % eval_every == eval_every - 1) == (split == "eval")
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, _concat(files, max_bytes))  # ranks may race: each renames whole bytes into place
    data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _concat(files: list[Path], max_bytes: int) -> bytes:
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        chunk = f.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


class ByteCorpus(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``L = seq_len`` bytes.

    Sample ``i`` is ``(bytes[i*L : i*L+L], bytes[i*L+1 : i*L+L+1])`` as int64 (inputs and next-byte targets).
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if data.dim() != 1 or data.numel() < seq_len + 1:
            raise UsageError(f"ByteCorpus: need a 1-D byte tensor of more than seq_len={seq_len} bytes")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]
