"""Worker progress for the agent's hang detection: one small memory-mapped record per worker, written without syscalls.

Under ``elasticzero-run`` every worker's environment names its record file (:data:`PROGRESS_FILE_ENV`, one per local
rank, in a private directory of the agent). The worker side opens it once, on first use, maps it, and from then on
reports progress with plain stores into shared memory (``struct.pack_into`` on the map; the clock read is
``time.monotonic_ns``, served by the vDSO): no syscall per step. Who reports:

* :func:`heartbeat` (public as ``elasticzero.heartbeat()``): a training loop that uses no engine piece calls it once per
  step (or more often: in a long evaluation, a checkpoint save of its own);
* the engine: :func:`~elasticzero.engine.step.optimizer_step` (``pieces.step()``) counts a step; every collective an
  engine :class:`~elasticzero.engine.zero.comm.Communicator` issues is numbered, and the number of the one a worker
  is blocked waiting in is recorded while it waits — so of ranks that stopped progressing, the one that did *not*
  enter the collective the others wait in can be told apart (docs/agent.md, "Hung workers");
* the live loop (:mod:`elasticzero.live`): each round it enters is counted and clears the last step's time (the
  next step's interval spans the round change, not a step) and the old round's abandoned wait; the worker marks
  when it waits in a bounded wait (the work — an engine collective, or a checkpoint save's collectives — runs on
  the bound's helper thread).

Opening the record also registers :mod:`faulthandler` on :data:`STACKS_SIGNAL`: the agent sends it to a hung worker,
whose Python stacks (every thread) then go to its stderr, i.e. its log. Outside the agent (no variable) everything here
is a no-op. The agent side reads records with :func:`read_record` (:mod:`elasticzero.agent.progress` decides).

The one process-wide object is the worker's reporter (:func:`reporter`, opened once per process, like ``faulthandler``
itself): a worker has one record, and the engine pieces of a process share it.
"""

from __future__ import annotations

import faulthandler
import functools
import mmap
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass

#: the variable naming a worker's record file (set by the agent's start hook, per local rank)
PROGRESS_FILE_ENV = "ELASTICZERO_PROGRESS_FILE"
#: the signal on which a worker with a record dumps its Python stacks to stderr (faulthandler)
STACKS_SIGNAL = signal.SIGUSR2

_MAGIC = b"EZP3"
#: magic, pid, beats (every report), step, collectives issued, collective waited in (0: none), last step's time (ns;
#: 0: no step in the current round), rounds entered (live recovery), in a bounded wait (0/1), the live round the
#: worker is in (its number + 1; 0: none), the live round in which a collective of its failed on a lost peer's error
#: (number + 1; 0: none)
_LAYOUT = struct.Struct("<4sIQQQQQQQQQ")
RECORD_SIZE = _LAYOUT.size
_OFF_BEATS = 8  # beats, step: one pack_into per step
_OFF_COLLECTIVES = 24
_OFF_WAITING = 32
_OFF_STEP_NS = 40
_OFF_BOUNDED = 56
_OFF_ROUND = 64
_OFF_FAILED = 72
_PAIR = struct.Struct("<QQ")
_TRIPLE = struct.Struct("<QQQ")  # waiting, step time, rounds: one pack_into per round entered
_ONE = struct.Struct("<Q")


@dataclass(frozen=True)
class ProgressRecord:
    """One worker's record as the agent reads it."""

    pid: int
    beats: int  #: reports so far (steps and heartbeats): any change is progress
    step: int  #: the step count reported (the engine's steps since the worker started, or the loop's own numbers)
    collectives: int  #: engine collectives issued so far
    waiting: int  #: the number of the engine collective the worker is blocked waiting in; 0 when it is not
    step_ns: int  #: ``time.monotonic_ns()`` when the last step was reported (0: none yet in the current round)
    rounds: int = 0  #: live rounds this process entered (0: none, outside live recovery); each entry zeroes step_ns
    bounded: int = 0  #: 1 while the worker waits in a live loop's bounded wait (:mod:`elasticzero.live.bounded`)
    round: int = 0  #: the live round the worker entered last, its number + 1 (0: none)
    #: the live round (number + 1) in which a collective failed on a lost peer's error (0: none since it entered one)
    failed_round: int = 0

    @property
    def marks(self) -> tuple[int, int, int, int]:
        """What changes when the worker makes progress."""
        return self.beats, self.collectives, self.waiting, self.bounded


def read_record(path: str) -> ProgressRecord | None:
    """The record in ``path``; None when there is none (not created yet, or not complete)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(RECORD_SIZE)
    except OSError:
        return None
    if len(data) < RECORD_SIZE:
        return None
    magic, *fields = _LAYOUT.unpack(data)
    return ProgressRecord(*fields) if magic == _MAGIC else None


class Reporter:
    """A worker's side of its record (see the module docstring); :func:`reporter` gives the process's one."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD_SIZE)
            self._map = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        self._beats = self._step = self._collectives = self._rounds = 0
        register_stack_dump()
        _LAYOUT.pack_into(self._map, 0, _MAGIC, os.getpid(), 0, 0, 0, 0, 0, 0, 0, 0, 0)

    def step(self) -> None:
        """The engine finished a step (its steps are counted from the worker's start)."""
        self.beat(self._step + 1)

    def beat(self, step: int | None = None) -> None:
        """Progress; with ``step``, the loop finished that step (its number and time are recorded)."""
        self._beats += 1
        if step is None:
            _ONE.pack_into(self._map, _OFF_BEATS, self._beats)
            return
        self._step = step
        # the time first: a reader that sees the new step sees its time (one that sees the time alone sees no step)
        _ONE.pack_into(self._map, _OFF_STEP_NS, time.monotonic_ns())
        _PAIR.pack_into(self._map, _OFF_BEATS, self._beats, step)

    def entered_round(self, number: int) -> None:
        """The live loop enters round ``number``: no step in it yet (the next step's interval spans the round change),
        no wait of the old round's (abandoned: a helper thread left in one never clears it, its wait ends in an
        error), no failed collective."""
        self._rounds += 1
        _TRIPLE.pack_into(self._map, _OFF_WAITING, 0, 0, self._rounds)
        _PAIR.pack_into(self._map, _OFF_ROUND, number + 1, 0)

    def peer_failed(self) -> None:
        """A collective of the live round the worker is in failed on a lost peer's error (a closed connection): the
        agent asks the round's nodes at once (:mod:`elasticzero.agent.suspicion`)."""
        current = _ONE.unpack_from(self._map, _OFF_ROUND)[0]
        _ONE.pack_into(self._map, _OFF_FAILED, current)

    def bounded(self, inside: bool) -> None:
        """The worker enters (``True``) or leaves a live loop's bounded wait."""
        _ONE.pack_into(self._map, _OFF_BOUNDED, int(inside))

    def issued(self) -> int:
        """Number the next engine collective (1, 2, ...) and record it as issued."""
        self._collectives += 1
        _ONE.pack_into(self._map, _OFF_COLLECTIVES, self._collectives)
        return self._collectives

    def waiting(self, seq: int) -> None:
        """The worker blocks waiting in engine collective ``seq`` (0: no longer waiting)."""
        _ONE.pack_into(self._map, _OFF_WAITING, seq)


class NullReporter(Reporter):
    """The reporter outside the agent: every report is a no-op."""

    def __init__(self) -> None:  # no record, no signal handler
        pass

    def step(self) -> None:
        pass

    def beat(self, step: int | None = None) -> None:
        pass

    def entered_round(self, number: int) -> None:
        pass

    def peer_failed(self) -> None:
        pass

    def bounded(self, inside: bool) -> None:
        pass

    def issued(self) -> int:
        return 0

    def waiting(self, seq: int) -> None:
        pass


@functools.cache
def reporter() -> Reporter:
    """This process's reporter: on its record when the agent named one (:data:`PROGRESS_FILE_ENV`), else a no-op.

    Opened once per process; a record that cannot be opened warns once and reports nothing (training goes on)."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return NullReporter()
    try:
        return Reporter(path)
    except OSError as exc:
        print(f"elasticzero: no progress record ({path}: {exc}); no hang detection for this worker", file=sys.stderr)
        return NullReporter()


def heartbeat(step: int | None = None) -> None:
    """Tell the agent this worker makes progress.

    A loop that uses no engine piece calls ``heartbeat(step)`` after each step (the engine's ``optimizer_step`` reports
    its steps itself): the step's number, shown when the agent reports a hang, and its time (the default hang timeout
    follows the step times). Without ``step``: progress that is not a step — call it now and then during a long pause
    of the loop's own (an evaluation, a wait). Cheap (no syscall); a no-op outside ``elasticzero-run``. See
    docs/agent.md, "Hung workers"."""
    reporter().beat(step)


def register_stack_dump() -> None:
    """Dump every thread's Python stack to stderr on :data:`STACKS_SIGNAL` (a handler the script set still runs)."""
    chain = signal.getsignal(STACKS_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=chain)
