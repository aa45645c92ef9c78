"""Bounded waits: gloo cannot abort a collective, so the engine's waits are made leavable.

A :class:`BoundedWait` is a :data:`~elasticzero.engine.zero.comm.work.Waiter`: given to the engine's communicators
(``Communicator(group, waiter=bound)``, ``BuddyCopies(..., waiter=bound)``), every wait of their works runs on the
bound's helper thread while the calling thread waits for it ``poll_s`` at a time and, between two, polls the round
source. When a newer round is announced the caller leaves with :class:`Reconfigure` (the round); when the work fails
(a peer's socket closed: SIGKILL) it waits up to ``failure_grace_s`` for the agent's round, then leaves with
:class:`Reconfigure` too (or re-raises the failure when no round came). gloo does not fail every wait on a lost peer:
a receive whose sender dies while its message is in flight waits for good, although gloo closed that peer's
connection. So a wait that lasts (``lost_after_s``) also asks ``lost`` — whether a connection of the round's group
was closed (:meth:`~elasticzero.live.group.RoundGroups.lost`) — and takes a yes as the wait's failure
(:class:`PeerConnectionLost`). gloo may also fail a collective when it is
*issued* (posting a receive on a closed pair raises): the loop construct hands such an error to
:meth:`BoundedWait.after_failure` itself. While a wait runs the worker's progress record says so
(:meth:`~elasticzero.progress.Reporter.bounded`): the agent's hang line tells a worker waiting on other work on the
thread (a checkpoint save's collectives) from one outside every wait.

Why a thread and not ``work.wait(timeout)`` in a loop: for gloo's point-to-point works (the rings, the buddy copies'
exchange) ``wait(timeout)`` that times out signals the error to every pair of the context (the whole group is broken:
"Application timeout caused pair closure"), and their ``is_completed()`` stays false until ``wait()`` — so a short
timed wait can only be used where the group is given up anyway. The thread waits without a bound.

The same bound runs code that issues collectives outside the engine's works — a round's ``build`` (the engine's
broadcast of the module's state), the first round's load of the checkpoint (DCP's collectives): :meth:`BoundedWait.call`
runs the whole callable on the helper thread and returns its result. There the callable's own error (a
``ValueError`` in the user's build, an out-of-memory) is raised at once, not after the grace for a round: the caller
says which errors are a lost peer's (``peer``). The helper thread works on the bound's CUDA device (``device``: the
current device is per thread; NCCL's object collectives and the build's allocations on ``cuda`` read it).

Abandoning: once it raised :class:`Reconfigure` a bound refuses every later wait (:attr:`BoundedWait.abandoned`), so
nothing issues or waits on the old group again. The helper thread (a daemon) stays blocked in the abandoned wait, and
gloo's own worker thread in the collective, until the old group's timeout fires or the lost peer's sockets close (the
agent kills a frozen worker: fencing); either ends the wait with an error nobody reads. The old group is left by
:mod:`.group` (destroyed, NCCL aborted first) but stays referenced, so nothing joins those threads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from elasticzero.progress import reporter
from elasticzero.rounds import NodeRound, RoundError


class Reconfigure(Exception):
    """A newer round is in the round file while this process waited on the old group: form ``round``'s group."""

    def __init__(self, round_: NodeRound) -> None:
        super().__init__(f"round {round_.number} announced: {round_.world_size} member(s)")
        self.round = round_


class PeerConnectionLost(RuntimeError):
    """A connection of the round's group closed while a wait of it went on (the wait itself may never fail)."""


class LiveError(RuntimeError):
    """Live reconfiguration cannot go on in this process (a bad round file, not a member of the new round, a failed
    reconfiguration): exit, and the agent's restart path takes over (disk checkpoint)."""


Poll = Callable[[], NodeRound | RoundError | None]
T = TypeVar("T")


def leave_for(found: NodeRound | RoundError | None) -> Reconfigure | None:
    """The exception a wait leaves with for what the round source said (``None``: keep waiting); a
    :class:`RoundError` is raised as :class:`LiveError`."""
    if isinstance(found, RoundError):
        raise LiveError(found.reason)
    return Reconfigure(found) if found is not None else None


class BoundedWait:
    """Waits the engine's works on a helper thread, leaving when ``poll`` reports a newer round (see the module).

    Args:
        poll: the round file's decision for this process's current round (:meth:`RoundFile.poll` bound to it).
        poll_s: how long a wait runs between two polls (the bound on leaving after an announcement).
        failure_grace_s: after a work failed, how long to wait for the agent's round before re-raising the failure.
        device: the CUDA device the helper thread works on (``torch.cuda.set_device`` there); None: the CPU.
        lost: whether a connection of the round's group closed (None: not asked); asked every ``lost_after_s`` of a
            wait, from the first ``lost_after_s`` on.
        urgent: the round source after a work failed (default ``poll``): the loop's switches at once there, where
            ``poll`` may let a join wait for a step boundary — a failed step never reaches one.
    """

    def __init__(
        self,
        poll: Poll,
        *,
        poll_s: float = 0.05,
        failure_grace_s: float = 30.0,
        device: str | None = None,
        lost: Callable[[], bool] | None = None,
        lost_after_s: float = 0.25,
        urgent: Poll | None = None,
    ) -> None:
        self.poll, self.urgent = poll, urgent or poll
        self.poll_s = poll_s
        self.failure_grace_s = failure_grace_s
        self.device = device
        self.lost, self.lost_after_s = lost, lost_after_s
        self.abandoned: NodeRound | None = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="ez-bounded-wait", daemon=True)
        self._thread.start()

    def __call__(self, wait: Callable[[], None]) -> None:
        """Run ``wait`` (a work's blocking wait), leaving with :class:`Reconfigure` on a new round (the source is
        polled only once the wait took ``poll_s``: a wait that completes costs no store traffic)."""
        self.call(wait)

    def call(self, work: Callable[[], T], peer: Callable[[BaseException], bool] = lambda _: True) -> T:
        """Run ``work`` on the helper thread, bounded like a wait; its result. An error ``peer`` does not call a lost
        peer's is ``work``'s own: raised at once (a lost peer's waits up to the grace for the agent's round)."""
        if self.abandoned is not None:
            raise Reconfigure(self.abandoned)
        done: Future[T] = Future()
        reporter().bounded(True)  # before the thread starts the work: the agent's hang line says where the worker is
        try:
            self._jobs.put((work, done))
            return self._wait_for(done, peer)
        finally:
            reporter().bounded(False)

    def _wait_for(self, done: Future[T], peer: Callable[[BaseException], bool]) -> T:
        next_look = time.monotonic() + self.lost_after_s
        while True:
            try:
                return done.result(timeout=self.poll_s)
            except FutureTimeout:
                self._leave_if(self.poll())
                if self.lost is not None and time.monotonic() >= next_look:
                    next_look = time.monotonic() + self.lost_after_s
                    if self.lost():
                        self.after_failure(PeerConnectionLost("a connection of this round's group closed mid-wait"))
            except Exception as err:
                if not peer(err):
                    raise
                self.after_failure(err)

    def check(self) -> None:
        """Raise :class:`Reconfigure` if this bound was abandoned or a newer round is announced now."""
        if self.abandoned is not None:
            raise Reconfigure(self.abandoned)
        self._leave_if(self.poll())

    def close(self) -> None:
        """Let the helper thread end (after the wait it is in, if any)."""
        self._jobs.put(None)

    def _leave_if(self, found: NodeRound | RoundError | None) -> None:
        leave = leave_for(found)
        if leave is not None:
            self.abandoned = leave.round
            self._jobs.put(None)  # the thread ends once the abandoned wait does
            raise leave

    def after_failure(self, err: BaseException) -> None:
        """A collective failed (a peer's sockets closed; at its wait, or already when it was issued): the agent's
        round is expected. The worker's progress record says so first: its agent asks the round's nodes at once
        (:mod:`elasticzero.agent.suspicion`), so a crash costs no heartbeat timeout. Raise :class:`Reconfigure` (from
        ``err``) if the round comes within ``failure_grace_s``, else ``err``."""
        reporter().peer_failed()
        deadline = time.monotonic() + self.failure_grace_s
        while time.monotonic() < deadline:
            try:
                self._leave_if(self.urgent())
            except Reconfigure as leave:
                raise leave from err
            time.sleep(self.poll_s)
        raise err

    def _serve(self) -> None:
        device = self.device  # set on this thread before its first work: an error there is that work's
        while (job := self._jobs.get()) is not None:
            work, done = job
            try:
                if device is not None:
                    _set_device(device)
                    device = None
                result = work()
            except BaseException as err:  # handed to the waiting caller
                done.set_exception(err)
            else:
                done.set_result(result)


def _set_device(device: str) -> None:
    import torch

    torch.cuda.set_device(torch.device(device))


class Unbounded:
    """The bound of a static round (a plain run: no round file): every wait runs on the calling thread, no round is
    ever announced, and a failure is raised as it is (the restart path)."""

    abandoned: NodeRound | None = None

    def __call__(self, wait: Callable[[], None]) -> None:
        wait()

    def call(self, work: Callable[[], T], peer: Callable[[BaseException], bool] = lambda _: True) -> T:
        """``work``'s result, run here (``peer`` unused: every error is raised as it is)."""
        return work()

    def check(self) -> None:
        """Nothing to leave for: a static round is never replaced in its process."""

    def after_failure(self, err: BaseException) -> None:
        raise err

    def close(self) -> None:
        """Nothing runs beside the caller."""
