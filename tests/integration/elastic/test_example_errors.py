"""The example job on an error path: ``examples/train_gpt.py``'s trainer, in this process (a world of one on a
HashStore, as the example runs alone), fails after an async save was handed to the writer thread — the checkpointer
is closed all the same: that save committed and the writer thread is gone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from elasticzero.checkpoint import commit
from ez_testing import REPO

pytestmark = pytest.mark.timeout(120)


class Failed(RuntimeError):
    """The error the trainer below raises."""


def test_an_error_after_an_async_save_still_closes_the_checkpointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # the example and its gpt.py
    import train_gpt

    trainers: list[Any] = []

    class FailingTrainer(train_gpt.Trainer):
        def evaluate(self, global_batches: int = 2) -> None:  # the final evaluation, right after the last save
            trainers.append(self)
            raise Failed("evaluation failed")

    argv = ["--size", "tiny", "--seq-len", "32", "--steps", "1", "--async-save", "--corpus-bytes", "65536"]
    argv += ["--cache-dir", str(tmp_path / "corpus"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    before = set(threading.enumerate())
    with pytest.raises(Failed):
        train_gpt.main(argv, FailingTrainer)
    ckpt = trainers[0].ckpt
    assert not ckpt.saving and commit.latest_step(commit.list_dir(ckpt.directory)) == 1  # the last save committed
    writers = [t for t in set(threading.enumerate()) - before if t.name.startswith("elasticzero-ckpt")]
    assert writers == []  # and its thread stopped (close shuts the executor down)
