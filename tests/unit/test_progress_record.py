"""A worker's progress record (elasticzero.progress): what the worker writes is what the agent reads."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import elasticzero
from elasticzero import progress
from elasticzero.progress import STACKS_SIGNAL, NullReporter, ProgressRecord, Reporter, read_record


@pytest.fixture
def record(tmp_path: Path) -> Iterator[tuple[Reporter, Path]]:
    path = tmp_path / "rank0"
    rep = Reporter(str(path))
    try:
        yield rep, path
    finally:
        faulthandler.unregister(STACKS_SIGNAL)


def test_reports_land_in_the_record(record: tuple[Reporter, Path]) -> None:
    rep, path = record
    assert read_record(str(path)) == ProgressRecord(os.getpid(), 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert (rep.issued(), rep.issued()) == (1, 2)
    rep.waiting(2)
    got = read_record(str(path))
    assert got is not None and (got.collectives, got.waiting, got.beats) == (2, 2, 0)
    rep.waiting(0)
    rep.step()
    rep.step()
    rep.beat()  # progress that is not a step: the step and its time stay
    got = read_record(str(path))
    assert got is not None and (got.beats, got.step, got.waiting) == (3, 2, 0) and got.step_ns > 0
    rep.beat(40)
    got2 = read_record(str(path))
    assert got2 is not None and (got2.beats, got2.step) == (4, 40) and got2.step_ns >= got.step_ns


def test_a_round_entered_clears_the_step_time_and_a_bounded_wait_is_marked(record: tuple[Reporter, Path]) -> None:
    """The live loop's reports: a round entered is counted and leaves no step time (nor wait) in it until its first
    step; a bounded wait shows in the record (and is progress: the marks change)."""
    rep, path = record
    rep.step()
    rep.waiting(rep.issued())  # a wait of the old round, abandoned: its thread never clears it
    before = read_record(str(path))
    rep.entered_round(0)
    entered = read_record(str(path))
    assert before is not None and entered is not None and (before.step_ns > 0, before.waiting) == (True, 1)
    assert (entered.rounds, entered.step_ns, entered.step, entered.waiting, entered.collectives) == (1, 0, 1, 0, 1)
    assert entered.round == 1  # round 0, stored + 1 (0: none)
    rep.step()
    rep.bounded(True)
    inside = read_record(str(path))
    assert inside is not None and (inside.rounds, inside.step, inside.bounded) == (1, 2, 1) and inside.step_ns > 0
    rep.bounded(False)
    left = read_record(str(path))
    assert left is not None and left.bounded == 0 and len({inside.marks, left.marks}) == 2


def test_a_failed_collective_is_marked_with_its_round_until_the_next_round(record: tuple[Reporter, Path]) -> None:
    """The symptom of a crashed peer (elasticzero.agent.suspicion): a failed collective is recorded with the round it
    failed in; entering the next round clears it (a failure of the old round's abandoned wait is no news there)."""
    rep, path = record
    rep.entered_round(6)
    rep.peer_failed()
    failed = read_record(str(path))
    assert failed is not None and (failed.round, failed.failed_round) == (7, 7)
    rep.entered_round(7)
    entered = read_record(str(path))
    assert entered is not None and (entered.round, entered.failed_round) == (8, 0)


def test_no_record_reads_as_none(tmp_path: Path) -> None:
    assert read_record(str(tmp_path / "missing")) is None
    (tmp_path / "short").write_bytes(b"EZP1")
    assert read_record(str(tmp_path / "short")) is None
    (tmp_path / "other").write_bytes(bytes(progress.RECORD_SIZE))
    assert read_record(str(tmp_path / "other")) is None


def test_outside_the_agent_everything_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.PROGRESS_FILE_ENV, raising=False)
    progress.reporter.cache_clear()
    try:
        assert isinstance(progress.reporter(), NullReporter)
        elasticzero.heartbeat()
        elasticzero.heartbeat(3)
        assert progress.reporter().issued() == 0
    finally:
        progress.reporter.cache_clear()


def test_the_stack_signal_dumps_without_ending_the_process(tmp_path: Path) -> None:
    """A worker with a record dumps its stacks on the signal and runs on (a real process: faulthandler writes to the
    stderr file descriptor it was given)."""
    script = (
        "import os, elasticzero\n"
        "def in_the_loop():\n"
        "    elasticzero.heartbeat(1)\n"
        f"    os.kill(os.getpid(), {int(STACKS_SIGNAL)})\n"
        "in_the_loop()\n"
        "print('alive')\n"
    )
    env = {**os.environ, progress.PROGRESS_FILE_ENV: str(tmp_path / "rank0")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "alive\n"), out.stderr
    assert "most recent call first" in out.stderr and "line 4 in in_the_loop" in out.stderr
    got = read_record(str(tmp_path / "rank0"))
    assert got is not None and (got.pid, got.step) != (os.getpid(), 0)
