"""The stdlib byte corpus: a deterministic file list and order, a cached split, next-byte windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticzero.data import ByteCorpus, stdlib_corpus
from elasticzero.data import corpus as corpus_mod
from elasticzero.errors import UsageError


def test_file_list_is_sorted_by_relative_path_without_tests(tmp_path: Path) -> None:
    for rel in ("b.py", "a/z.py", "a/test/t.py", "tests/x.py", "site-packages/p.py", "a/m.txt", "A.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    files = corpus_mod.stdlib_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["A.py", "a/z.py", "b.py"]


def test_splits_are_cached_disjoint_and_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = stdlib_corpus(tmp_path, "train", max_bytes=4096)
    evals = stdlib_corpus(tmp_path, "eval", max_bytes=4096)
    assert train.dtype == torch.uint8 and train.numel() == evals.numel() == 4096
    assert not torch.equal(train, evals)
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("stdlib-*.bin")) == ["eval", "train"]
    monkeypatch.setattr(corpus_mod, "_concat", lambda *a: pytest.fail("the cached bytes were not reused"))
    assert torch.equal(stdlib_corpus(tmp_path, "train", max_bytes=4096), train)
    with pytest.raises(UsageError, match="split must be 'train' or 'eval', got 'test'"):
        stdlib_corpus(tmp_path, "test")


def test_windows_are_inputs_and_next_byte_targets() -> None:
    data = torch.arange(23, dtype=torch.uint8)
    ds = ByteCorpus(data, seq_len=5)
    assert len(ds) == 4  # 22 // 5: the last window needs one byte past it for its target
    x, y = ds[3]
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20] and x.dtype == torch.int64
    with pytest.raises(UsageError, match="more than seq_len=30 bytes"):
        ByteCorpus(data, seq_len=30)


def test_default_cache_is_the_users_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus_mod.default_cache_dir() == tmp_path / "xdg" / "elasticzero"
    train = stdlib_corpus(None, "train", max_bytes=512)
    assert [p.parent for p in (tmp_path / "xdg").rglob("stdlib-train-*.bin")] == [tmp_path / "xdg" / "elasticzero"]
    assert torch.equal(stdlib_corpus(tmp_path / "own", "train", max_bytes=512), train)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the XDG rule says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert corpus_mod.default_cache_dir() == tmp_path / "home" / ".cache" / "elasticzero"
