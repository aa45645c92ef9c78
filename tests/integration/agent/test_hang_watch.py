"""The agent's hang watch (elasticzero.agent.hang) on real processes: a worker that stops reporting is named, dumps
its stacks (a stopped one cannot) and is killed; one that keeps reporting is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elasticzero.agent.hang import HangWatch
from elasticzero.agent.progress import HangPlan
from elasticzero.progress import PROGRESS_FILE_ENV, read_record

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.5  # seconds: the watched child reports its first step, then (unless told to go on) stops reporting
CHILD = """
import sys, time, elasticzero
def stuck_in_the_loop():
    while True:
        time.sleep(0.05)
        if sys.argv[1] == "beat":
            elasticzero.heartbeat()
elasticzero.heartbeat(7)
print("ready", flush=True)
stuck_in_the_loop()
"""


@dataclass
class FakeWorker:  # the fields of torch's Worker the watch reads
    id: int
    local_rank: int = 0
    global_rank: int = 3


@dataclass
class FakeGroup:
    workers: list[FakeWorker] = field(default_factory=list)


@pytest.fixture
def watch(tmp_path: Path) -> HangWatch:
    w = HangWatch(HangPlan(True, TIMEOUT, str(tmp_path / "progress")))
    w.start()
    return w


@pytest.fixture
def child(watch: HangWatch, request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, **watch.plan.worker_env(0)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, request.param], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def watch_for(watch: HangWatch, group: FakeGroup, seconds: float):
    """Check every 0.1 s for ``seconds``; the first verdict, or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hang = watch.check(group)  # type: ignore[arg-type]
        if hang is not None:
            return hang
        time.sleep(0.1)
    return None


@pytest.mark.parametrize("child", ["stop"], indirect=True)
def test_a_worker_that_stops_reporting_dumps_its_stacks_and_is_killed(
    watch: HangWatch, child: subprocess.Popen[str], capsys: pytest.CaptureFixture[str]
) -> None:
    hang = watch_for(watch, FakeGroup([FakeWorker(child.pid)]), 10 * TIMEOUT)
    assert hang is not None and (hang.rank, hang.pid, hang.step, hang.stopped) == (3, child.pid, 7, False)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert "line 5 in stuck_in_the_loop" in child.communicate()[1]  # faulthandler's dump, on the worker's stderr
    line = capsys.readouterr().err
    assert line.startswith(f"elasticzero-run: hang: rank 3 (local rank 0, pid {child.pid}) made no progress")
    assert "after step 7" in line and "Python stacks: in its log" in line


@pytest.mark.parametrize("child", ["stop"], indirect=True)
def test_a_stopped_worker_is_killed_without_stacks(
    watch: HangWatch, child: subprocess.Popen[str], capsys: pytest.CaptureFixture[str]
) -> None:
    os.kill(child.pid, signal.SIGSTOP)
    hang = watch_for(watch, FakeGroup([FakeWorker(child.pid)]), 10 * TIMEOUT)
    assert hang is not None and hang.stopped
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert "most recent call first" not in child.communicate()[1]
    assert "Python stacks: none: a stopped process cannot dump them" in capsys.readouterr().err


@pytest.mark.parametrize("child", ["beat"], indirect=True)
def test_a_worker_that_reports_is_left_alone(watch: HangWatch, child: subprocess.Popen[str]) -> None:
    assert watch_for(watch, FakeGroup([FakeWorker(child.pid)]), 6 * TIMEOUT) is None
    assert child.poll() is None


def test_start_forgets_the_last_round_and_close_removes_the_records(watch: HangWatch) -> None:
    path = watch.plan.record_file(0)
    assert path is not None
    Path(path).write_bytes(b"stale")
    watch.start()
    assert not os.path.exists(path) and read_record(path) is None
    watch.close()
    assert not os.path.exists(os.path.dirname(path))
    assert PROGRESS_FILE_ENV in watch.plan.worker_env(0)
