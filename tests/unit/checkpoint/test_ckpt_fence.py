"""Fencing of a checkpoint directory: the newest Checkpointer's world owns it; an older one's write, commit and
deletion there raise FencedError (two Checkpointers in one single-rank gloo world stand for a stale and a new world).
A read-only Checkpointer and the checkpoint CLI claim nothing."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticzero.checkpoint import Checkpointer, FencedError, cli
from elasticzero.checkpoint.fence import WRITER, claim, current, fenced_message
from elasticzero.errors import UsageError


@pytest.fixture(scope="module")
def gloo_world() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_decision_names_the_directory_the_step_and_both_worlds(tmp_path: Path) -> None:
    assert fenced_message(tmp_path, "the commit", 12, "aa", "aa") is None
    line = fenced_message(tmp_path, "the commit", 12, "aa", "bb")
    assert line is not None and str(tmp_path) in line and "step 12 refused" in line and "bb" in line and "aa" in line
    assert "no world" in str(fenced_message(tmp_path, "the commit", 12, "aa", None))


def test_a_claim_replaces_the_writer(tmp_path: Path) -> None:
    first = claim(tmp_path / "ckpt")
    assert current(tmp_path / "ckpt") == first
    second = claim(tmp_path / "ckpt")
    assert second != first and current(tmp_path / "ckpt") == second
    (tmp_path / "ckpt" / WRITER).write_text("not json")
    assert current(tmp_path / "ckpt") is None


def test_a_stale_checkpointer_writes_nothing_after_a_new_one_claimed(gloo_world: None, tmp_path: Path) -> None:
    state = {"w": {"t": torch.arange(4.0)}}
    stale = Checkpointer(tmp_path, keep_last=1)
    stale.save(1, state)
    fresh = Checkpointer(tmp_path, keep_last=1)  # the new world formed
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FencedError, match="this rank's write of step 2 refused"):
        stale.save(2, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # not even a temporary directory
    fresh.save(2, state)
    assert fresh.latest_step() == 2
    stale.close()
    fresh.close()


def test_the_commit_is_fenced_too(gloo_world: None, tmp_path: Path) -> None:
    state = {"w": {"t": torch.arange(4.0)}}
    claims: list[Checkpointer] = []

    def new_world_forms(phase: str, step: int) -> None:  # between this rank's write and its commit
        if phase == "manifest" and not claims:
            claims.append(Checkpointer(tmp_path, keep_last=1))

    stale = Checkpointer(tmp_path, keep_last=1, phase_hook=new_world_forms)
    with pytest.raises(FencedError, match="the commit of step 3 refused"):
        stale.save(3, state)
    assert not (tmp_path / "step-00000003").exists() and not (tmp_path / "latest").exists()
    claims[0].close()


def test_a_read_only_checkpointer_loads_beside_the_writer_without_fencing_it(gloo_world: None, tmp_path: Path) -> None:
    writer = Checkpointer(tmp_path, keep_last=2)
    writer.save(1, {"w": {"t": torch.arange(4.0)}})
    token = current(tmp_path)
    loaded = {"w": {"t": torch.zeros(4)}}
    with Checkpointer(tmp_path, read_only=True) as reader:  # a tool beside the running job
        assert reader.load_latest(loaded) == 1
    torch.testing.assert_close(loaded["w"]["t"], torch.arange(4.0), rtol=0, atol=0)
    assert current(tmp_path) == token  # the directory still belongs to the job ...
    writer.save(2, {"w": {"t": torch.arange(4.0) + 1}})  # ... which goes on saving (a claim would fence it here)
    assert writer.latest_step() == 2
    writer.close()


def test_a_read_only_checkpointer_refuses_to_save_and_writes_nothing(gloo_world: None, tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.load_latest({"w": {"t": torch.zeros(4)}}) is None  # nothing committed: the state is untouched
        with pytest.raises(UsageError, match=r"save of step 3 refused: this Checkpointer is read-only"):
            reader.save(3, {"w": {"t": torch.arange(4.0)}})
    assert not (tmp_path / "ckpt").exists()  # not even the directory or its writer file


def test_read_only_with_async_save_is_a_usage_error(gloo_world: None, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="read_only=True saves nothing; drop async_save"):
        Checkpointer(tmp_path, read_only=True, async_save=True)


def test_the_checkpoint_cli_claims_nothing(
    gloo_world: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = Checkpointer(tmp_path, keep_last=2)
    writer.save(1, {"w": {"t": torch.arange(4.0)}})
    token = current(tmp_path)
    assert cli.main(["inspect", str(tmp_path)]) == 0 and cli.main(["verify", str(tmp_path)]) == 0
    assert "step 1: OK" in capsys.readouterr().out
    assert current(tmp_path) == token
    writer.save(2, {"w": {"t": torch.arange(4.0)}})
    writer.close()
