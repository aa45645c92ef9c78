"""The example job on an error path: ``examples/train_gpt.py``'s training, in this process (a world of one on a
HashStore, as the example runs alone), fails after an async save was handed to the writer thread (a hook raises right
after the last save) — the checkpointer is closed all the same: that save committed and the writer thread is gone."""

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
    from elasticzero.live import Hooks

    trainings: list[Any] = []

    class FailAfterTheLastSave(Hooks):
        def before_step(self, training: Any, attempt: Any) -> None:  # after the due work: the last save, here
            if training.step == training.total:
                trainings.append(training)
                raise Failed("failed after the last save")

    argv = ["--size", "tiny", "--seq-len", "32", "--steps", "1", "--async-save", "--corpus-bytes", "65536"]
    argv += ["--cache-dir", str(tmp_path / "corpus"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    before = set(threading.enumerate())
    with pytest.raises(Failed):
        train_gpt.main(argv, hooks=[FailAfterTheLastSave()])
    ckpt = trainings[0].kit.checkpointer
    assert not ckpt.saving and commit.latest_step(commit.list_dir(ckpt.directory)) == 1  # the last save committed
    writers = [t for t in set(threading.enumerate()) - before if t.name.startswith("elasticzero-ckpt")]
    assert writers == []  # and its thread stopped (close shuts the executor down)
