"""Bounded waits over plain blocking callables (what a gloo work's ``wait`` is to them) and a scripted round source
(real gloo ranks: tests/integration/live/test_live_loop.py)."""

from __future__ import annotations

import faulthandler
import threading
import time
from pathlib import Path

import pytest

from elasticzero import progress
from elasticzero.live.bounded import BoundedWait, LiveError, PeerConnectionLost, Reconfigure
from elasticzero.rounds import NodeRound, RoundError, StoreAddress

pytestmark = pytest.mark.timeout(60)
ROUND = NodeRound(1, 1, ((0, 0),), StoreAddress("127.0.0.1", 29500, False), "round1/")


class Source:
    """A round source that announces ``found`` once ``announced`` is set."""

    def __init__(self, found: NodeRound | RoundError = ROUND) -> None:
        self.announced = threading.Event()
        self.found = found
        self.polls = 0

    def __call__(self) -> NodeRound | RoundError | None:
        self.polls += 1
        return self.found if self.announced.is_set() else None


def test_a_wait_that_completes_returns_without_polling() -> None:
    source = Source()
    bound = BoundedWait(source, poll_s=5)
    bound(lambda: None)
    assert (bound.abandoned, source.polls) == (None, 0)
    bound.close()


def test_the_progress_record_shows_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the work runs on the helper thread the worker's record says it waits in a bounded wait (the agent's hang
    line), and not after."""
    path = str(tmp_path / "rank0")
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, path)
    progress.reporter.cache_clear()
    seen: list[progress.ProgressRecord | None] = []
    try:
        bound = BoundedWait(Source(), poll_s=5)
        bound(lambda: seen.append(progress.read_record(path)))
        bound.close()
        assert [r.bounded if r else None for r in (*seen, progress.read_record(path))] == [1, 0]
    finally:
        progress.reporter.cache_clear()
        faulthandler.unregister(progress.STACKS_SIGNAL)


def test_a_stuck_wait_is_left_within_a_poll_of_the_announcement() -> None:
    source, stuck = Source(), threading.Event()
    bound = BoundedWait(source, poll_s=0.02)
    timer = threading.Timer(0.2, source.announced.set)
    timer.start()
    with pytest.raises(Reconfigure) as left:
        bound(stuck.wait)  # never set: a collective whose peer froze
    late = time.monotonic()
    assert left.value.round == ROUND and bound.abandoned == ROUND
    with pytest.raises(Reconfigure):  # an abandoned bound never waits on the old group again
        bound(lambda: None)
    stuck.set()  # the abandoned wait ends (the group's timeout, the peer's sockets closing): its thread goes
    assert time.monotonic() - late < 1


def test_a_failed_wait_waits_for_the_round_then_leaves_for_it() -> None:
    source = Source()

    def fails() -> None:
        threading.Timer(0.1, source.announced.set).start()
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(Reconfigure) as left:
        BoundedWait(source, poll_s=0.02, failure_grace_s=10)(fails)
    assert isinstance(left.value.__cause__, RuntimeError)


def test_a_failure_without_a_round_is_raised_after_the_grace() -> None:
    bound = BoundedWait(Source(), poll_s=0.01, failure_grace_s=0.1)
    with pytest.raises(RuntimeError, match="closed by peer"):
        bound.after_failure(RuntimeError("closed by peer"))
    assert bound.abandoned is None


def test_a_wait_that_never_fails_is_left_once_a_connection_of_the_group_closed() -> None:
    """gloo's receive of a message whose sender died mid-way never fails: a wait that lasts asks ``lost`` (not before
    ``lost_after_s``), and a yes is the wait's failure — the agent's round is waited for, else it is raised."""
    source, stuck, asked = Source(), threading.Event(), []

    def lost() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 2  # the second look finds the connection closed

    bound = BoundedWait(source, poll_s=0.01, failure_grace_s=0.1, lost=lost, lost_after_s=0.05)
    start = time.monotonic()
    with pytest.raises(PeerConnectionLost, match="closed mid-wait"):
        bound(stuck.wait)
    assert len(asked) == 2 and asked[0] - start >= 0.05 and asked[1] - asked[0] >= 0.05
    bound2 = BoundedWait(source, poll_s=0.01, failure_grace_s=5, lost=lambda: True, lost_after_s=0.0)
    threading.Timer(0.1, source.announced.set).start()
    with pytest.raises(Reconfigure) as left:  # the agent's round came within the grace: left for it
        bound2(stuck.wait)
    assert isinstance(left.value.__cause__, PeerConnectionLost)
    stuck.set()


def test_a_broken_round_file_is_a_live_error() -> None:
    source = Source(RoundError("/run/round.json: not a round"))
    source.announced.set()
    with pytest.raises(LiveError, match="not a round"):
        BoundedWait(source).check()


def test_a_call_returns_its_result_from_the_helper_thread() -> None:
    bound = BoundedWait(Source(), poll_s=5)
    assert bound.call(threading.current_thread) is bound._thread  # the work ran there: the caller only polls
    bound.close()


def test_a_call_s_own_error_is_raised_at_once_without_waiting_for_a_round() -> None:
    """A round's build that fails of its own (a ``ValueError`` in the user's code, an out-of-memory) is no lost peer:
    raised as it is, without a poll of the round source (a lost peer's failure would poll it for the grace)."""
    source = Source()
    bound = BoundedWait(source, poll_s=5, failure_grace_s=60)

    def build() -> None:
        raise ValueError("the user's build")

    with pytest.raises(ValueError, match="the user's build"):
        bound.call(build, peer=lambda err: isinstance(err, RuntimeError))
    assert (source.polls, bound.abandoned) == (0, None)
    bound.close()


def test_a_call_stuck_in_a_collective_is_left_for_the_announced_round() -> None:
    """A build stuck in a broadcast a frozen member never joins: the caller leaves with the round; the abandoned
    build's thread ends whenever its collective does."""
    source, stuck = Source(), threading.Event()
    bound = BoundedWait(source, poll_s=0.02)
    threading.Timer(0.1, source.announced.set).start()
    with pytest.raises(Reconfigure) as left:
        bound.call(stuck.wait)
    assert left.value.round == ROUND
    stuck.set()


def test_the_helper_thread_works_on_the_bound_s_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The current CUDA device is per thread: the helper thread (which runs a round's build and every wait) is set to
    the bound's device before its first work; none on the CPU."""
    import torch

    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    cuda = BoundedWait(Source(), poll_s=5, device="cuda:1")
    cuda.call(lambda: None)
    cpu = BoundedWait(Source(), poll_s=5)
    cpu.call(lambda: None)
    assert calls == [("ez-bounded-wait", torch.device("cuda:1"))]
    cuda.close()
    cpu.close()


def test_a_device_that_cannot_be_set_fails_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error setting the helper thread's device is the first work's error (the thread serves on): never a thread
    dead before its first work, which would leave every call waiting."""
    import torch

    def no_device(d: torch.device) -> None:
        raise RuntimeError(f"CUDA error: invalid device ordinal {d}")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    bound = BoundedWait(Source(), poll_s=5, device="cuda:7")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        bound.call(lambda: None, peer=lambda err: False)
    bound.close()
