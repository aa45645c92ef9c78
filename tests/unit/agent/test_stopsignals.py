"""agent/stopsignals.py: the first stop signal raises torch's SignalException, no later one does."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from elasticzero.agent.stopsignals import StopSignals, decide
from elasticzero.proc import STOP_SIGNALS


@pytest.fixture
def handlers() -> Iterator[None]:
    """The stop signals at a terminal's defaults for the test (a run under ``nohup`` or in a shell's background
    inherits some ignored, and the agent rightly keeps an ignored one ignored), this process's handlers put back
    after it."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def handled(stop: StopSignals, n: int) -> None:
    """Wait until ``stop`` has noted ``n`` signals. Python runs a handler in the main thread at its next check of the
    eval breaker, not inside the C handler: a signal the kernel gave another thread (torch's, pytest-xdist's) is
    handled a moment after ``os.kill`` returns (CI: noted [] at the assert, under load). ``time.sleep`` is where the
    main thread takes it (PEP 475: the sleep runs the handlers); bounded, so a handler that never runs still fails."""
    deadline = time.monotonic() + 10
    while len(stop.noted) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_rule() -> None:
    assert decide(None, leaving=False) == "raise"
    assert decide(signal.SIGTERM, leaving=False) == "note"
    assert decide(None, leaving=True) == "note"
    assert decide(signal.SIGINT, leaving=True) == "note"


def test_first_raises_later_ones_are_noted_and_torch_is_overruled(handlers: None) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    stop = StopSignals()
    stop.install()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    for s in STOP_SIGNALS:
        signal.signal(s, signal.default_int_handler)  # as torch's process context does at each worker start
    stop.reinstall()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # still ignored
    assert signal.getsignal(signal.SIGTERM) == stop.handle
    with pytest.raises(SignalException) as exc:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises here at the latest (see handled)
    assert exc.value.sigval == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGQUIT)
    handled(stop, 2)
    assert (stop.first, stop.noted) == (signal.SIGTERM, [signal.SIGINT, signal.SIGQUIT])
    with pytest.raises(SignalException):  # the run went on after the first: its raise was lost
        stop.raise_if_lost()
    stop.leave()
    stop.raise_if_lost()  # over: nothing to raise
    assert all(signal.getsignal(s) is signal.SIG_IGN for s in STOP_SIGNALS)
    os.kill(os.getpid(), signal.SIGTERM)  # ignored: the process lives on


def test_the_agent_process_ends_at_once_on_a_startup_stop(handlers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the process (the console script) the start-up handler ends it with os._exit: a SystemExit raised inside
    torch's import, partly run from C++, was swallowed there (the stop lost, the job started) or aborted the process.
    In-process it raises SystemExit (the caller's process is not the agent's to end)."""
    from elasticzero.agent import cli

    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise InterruptedError  # stands for the end of the process: nothing after os._exit runs

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    cli.exit_on_stop_signals(process=True)
    with pytest.raises(InterruptedError):
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(10)  # the handler runs here at the latest (see handled)
    assert exits == [128 + signal.SIGHUP]
    cli.exit_on_stop_signals()
    with pytest.raises(SystemExit) as exc:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    assert (exc.value.code, exits) == (128 + signal.SIGTERM, [128 + signal.SIGHUP])
