"""The agent's stop signals once it runs: the first one stops it, no signal is ever raised twice.

torch's agent stops on SIGINT, SIGTERM, SIGHUP and SIGQUIT by raising ``SignalException`` from the signal handler
(``_terminate_process_handler``, installed by its process context every time workers start); its ``run()`` catches
it, stops the workers and re-raises. A job is seldom stopped by one signal: a Ctrl-C reaches the launcher, which
SIGTERMs the transport; pdsh's remote clean-up SIGTERMs the agent, then its ssh session ends (SIGHUP). With torch's
handler each of them raised again wherever the main thread was: inside torch's worker shutdown (cutting it short),
or — once the run had ended — inside a finalizer of the interpreter's teardown (the agent hosting the c10d store
spends seconds there, in the store's destructor), where Python prints the exception as ``Exception ignored in …``
with its traceback, and a signal after the handlers were reset killed the agent with the wrong code.

:class:`StopSignals` replaces torch's handler (from the launch on, and again after each worker start):
:func:`decide` is the rule — while the run goes on, the first stop signal raises torch's ``SignalException``
(torch's contract: its ``run()`` stops the workers, the agent exits ``128+N``); every later one, and any that comes
once the run is over (:meth:`StopSignals.leave`: ignored), changes nothing: the agent is already stopping, or
leaving with the run's own exit code. A launcher that must not wait escalates to SIGKILL (15 s after its SIGTERM).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping
from typing import Literal

from elasticzero.proc import STOP_SIGNALS

Action = Literal["raise", "note"]


def decide(first: int | None, leaving: bool) -> Action:
    """What a stop signal does: raise (the run's first, while it goes on) or only be noted."""
    return "raise" if first is None and not leaving else "note"


class StopSignals:
    """This process's stop-signal handler while the agent runs and leaves (one per agent process)."""

    def __init__(self) -> None:
        self.first: int | None = None  #: the stop signal that stopped the run, if one did
        self.noted: list[int] = []  #: every later one (and those after the run), in order
        self._leaving = False
        self._ignored: frozenset[int] = frozenset()  #: ignored when installed (``nohup``): kept ignored

    def install(self) -> Mapping[int, object]:
        """Handle :data:`~elasticzero.proc.STOP_SIGNALS` here (main thread only); the handlers it replaced.

        A signal the process ignores (``nohup``'s SIGHUP) stays ignored, as torch's handler would not know it.
        """
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {int(s): signal.getsignal(s) for s in STOP_SIGNALS}
        self._ignored = frozenset(s for s, h in previous.items() if h is signal.SIG_IGN)
        self.reinstall()
        return previous

    def reinstall(self) -> None:
        """Take the stop signals back from torch (its process context installs its handler at each worker start)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN if int(s) in self._ignored else self.handle)

    def raise_if_lost(self) -> None:
        """Raise the first stop signal again if the run goes on after it: its raise landed in a finalizer, which
        swallows exceptions (called on every monitor tick)."""
        if self.first is not None and not self._leaving:
            self._raise(self.first)

    def leave(self) -> None:
        """The run is over (returned or raised; its workers are stopped): the stop signals are ignored from now on.

        Nothing is left to stop, and the interpreter's teardown must neither raise one in a finalizer nor die of
        one at the default action with another exit code: Python resets the handlers it installed to the default
        before its last garbage collection (seconds on the node hosting the c10d store, in the store's
        destructor), but leaves an ignored signal ignored.
        """
        self._leaving = True
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)

    def handle(self, signum: int, _frame: object) -> None:
        if decide(self.first, self._leaving) == "note":
            self.noted.append(signum)
            return
        self.first = signum
        self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        """torch's exception for a stop signal, as its own handler raises it."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sigval = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
