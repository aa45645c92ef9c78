"""The example's live checkpoint rule (``examples/train_gpt.py``): whether a round's member takes the last committed
step's checkpoint — a collective — is decided only over what every member of the round agrees on (the pure rule
:func:`checkpoint_due`, and the trainer's ``held``, reset by every round's ``build``). The join race of issue 21 it
fixes, end to end under agents: tests/integration/elastic/test_live_e2e.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticzero.checkpoint.commit import step_dir
from elasticzero.errors import UsageError
from elasticzero.rounds import ROUND_FILE_ENV, NodeRound, StoreAddress, write_round
from ez_testing import REPO, free_port

SAVE, TOTAL = 5, 20
STEPS = 2  # a whole live job's (the last step's save after the loop)


@pytest.fixture
def train_gpt(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # as Python does for the script: its gpt.py beside it
    import train_gpt

    return train_gpt


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A world-size-1 gloo default group (each round's group in these tests), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_save_step_is_due_once_per_round(train_gpt: Any) -> None:
    due = train_gpt.checkpoint_due
    assert due(10, SAVE, TOTAL, held=None)
    assert not due(10, SAVE, TOTAL, held=10)  # this round's checkpointer saved it already
    assert not due(11, SAVE, TOTAL, held=10)  # not a save step
    assert due(TOTAL, 0, TOTAL, held=None)  # the job's last step, also without --save-every
    assert not due(0, SAVE, TOTAL, held=None)  # nothing committed yet
    assert not due(15, SAVE, TOTAL, held=15)  # the step the first round resumed from disk


@dataclass
class At:
    """Where the live loop is: the two things ``save_due`` reads of it (the committed step, the sampler there)."""

    step: int
    sampler: Any


class Saves:
    """``save_due``'s ``run``: runs the save (a real DCP checkpoint) and records who took it."""

    def __init__(self) -> None:
        self.taken: list[str] = []

    def by(self, who: str) -> Callable[[Callable[[], None]], None]:
        def run(save: Callable[[], None]) -> None:
            save()
            self.taken.append(who)

        return run


@pytest.mark.parametrize("old_round_saved", [False, True], ids=["announced-before-the-save", "after-the-save"])
def test_a_survivor_and_a_fresh_joiner_take_the_same_saves_in_the_new_round(
    train_gpt: Any, world_of_one: None, tmp_path: Path, old_round_saved: bool
) -> None:
    """The survivor commits save step 10 alone; a join's round is announced before its save ran (the race the bench
    hit: the survivor then took the save alone in the new round, while the fresh joiner trained — mismatched
    collectives, the round hung until the hang watch killed the survivor) or after it. In the new round both are at
    step 10 and both take step 10's checkpoint, once."""
    config = REPO / "examples" / "configs" / "gpt.yaml"
    argv = ["--config", str(config), "--zero", "2", "--size", "tiny", "--seq-len", "32", "--steps", str(TOTAL)]
    argv += ["--save-every", str(SAVE), "--corpus-bytes", "4700", "--cache-dir", str(tmp_path / "corpus")]
    # two ranks of one world share a directory and claim it together; here each is a world of one: one each
    parse = train_gpt.Trainer.parser().parse_args
    args = {who: parse([*argv, "--checkpoint-dir", str(tmp_path / who)]) for who in ("survivor", "joiner")}
    saves, group = Saves(), dist.group.WORLD

    survivor = train_gpt.LiveTrainer(args["survivor"])
    survivor.build(group)  # the old round
    if old_round_saved:
        survivor.save_due(At(10, survivor.sampler), saves.by("survivor, old round"))
    survivor.build(group)  # the new round: every member builds its pieces and checkpointer afresh
    joiner = train_gpt.LiveTrainer(args["joiner"])
    joiner.build(group)
    for who, trainer in (("survivor", survivor), ("joiner", joiner)):
        for _ in range(2):  # the attempt at step 10, then one redone in the same round: the save is taken once
            trainer.save_due(At(10, trainer.sampler), saves.by(who))
    assert saves.taken == ["survivor, old round"] * old_round_saved + ["survivor", "joiner"]
    assert all((tmp_path / who / step_dir(10)).is_dir() for who in args)


@pytest.fixture
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device rule sees a CPU machine (as in test_loop_rules.py): on a GPU one the round's group would be NCCL."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def live_args(train_gpt: Any, tmp_path: Path, *flags: str) -> Any:
    config = REPO / "examples" / "configs" / "gpt.yaml"
    argv = ["--config", str(config), "--zero", "2", "--size", "tiny", "--seq-len", "32", "--corpus-bytes", "4700"]
    argv += ["--cache-dir", str(tmp_path / "corpus"), "--checkpoint-dir", str(tmp_path / "ckpt"), *flags]
    return train_gpt.Trainer.parser().parse_args(argv)


@pytest.mark.parametrize("flag", [["--async-save"], ["--eval-every", "2"]], ids=["async-save", "eval-every"])
def test_live_mode_refuses_a_flag_it_cannot_bound(train_gpt: Any, tmp_path: Path, flag: list[str]) -> None:
    """Refused before any round is formed (nothing launched, nothing written): one line naming the flag."""
    trainer = train_gpt.LiveTrainer(live_args(train_gpt, tmp_path, "--steps", "4", *flag))
    with pytest.raises(UsageError, match=rf"^{flag[0]}: not under --live-recovery"):
        trainer.train()
    assert not dist.is_initialized() and not (tmp_path / "ckpt").exists()


def test_the_last_save_after_the_loop_is_taken_in_the_round_announced_before_it(
    train_gpt: Any, tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real LiveTrainer.train() in a world of one under a round file: round 1 is announced after the last step's
    commit, before its save after the loop (what a peer lost or a node joining there announces). The save leaves for
    round 1 (entered in this process, the state carried over) and is taken there, once, by round 1's checkpointer."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    monkeypatch.setenv(ROUND_FILE_ENV, path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen: dict[str, Any] = {}

    class Announcing(train_gpt.LiveTrainer):  # type: ignore[misc,name-defined]
        def save_last(self, live: Any) -> None:
            seen["live"], seen["before"] = live, self.ckpt
            write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
            super().save_last(live)
            seen["saved_by"] = self.ckpt

    trainer = Announcing(live_args(train_gpt, tmp_path, "--steps", str(STEPS)))
    try:
        trainer.train()
    finally:
        if "live" in seen:  # the last round's group stays the default group: leave it as test_loop_rules.py does
            seen["live"].groups.abandon()
    live = seen["live"]
    assert [(e.round.number, e.step) for e in live.events] == [(1, STEPS)]  # entered at the last step, none redone
    assert [s for s, _ in live.record] == list(range(STEPS))
    assert seen["saved_by"] is not seen["before"] and trainer.held == STEPS
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step")) == [step_dir(STEPS)]
