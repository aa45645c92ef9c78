"""Thin I/O of peer liveness: read the rendezvous state into a :class:`~elasticzero.agent.liveness.Snapshot`.

The state is torch's (``DynamicRendezvousHandler``): read under the handler's heartbeat lock, as torch's own
``num_nodes_waiting`` reads it, so this never races the keep-alive thread; the read syncs through torch's state
holder, which drops the nodes silent past the keep-alive age (the peer timeout). The read runs in a daemon thread and
the monitor loop never waits for it: a store that does not answer (c10d: its host is frozen, and torch's keep-alive
thread holds the lock while it waits) shows as a growing ``store_wait_s`` instead of a blocked agent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elasticzero.agent.liveness import Liveness, PeerPlan, Snapshot, gone_line, judge, store_lost_line


class StoreLostError(RendezvousConnectionError):
    """The c10d store's host (a peer's agent) has not answered for the peer timeout: this node cannot go on."""


@dataclass(frozen=True)
class PeerChange:
    """What the agent does about a verdict: re-form the round (``mark``: tell the others first) and why."""

    why: str
    mark: bool


@dataclass
class _Read:
    """One read of the state in flight, and the nodes it found alive (``None``: the store failed)."""

    done: threading.Event = field(default_factory=threading.Event)
    alive: frozenset[str] | None = None


class PeerWatch:
    """Watches the participants of one round (built after each rendezvous; :meth:`check` every monitor tick)."""

    def __init__(self, handler: Any, plan: PeerPlan) -> None:
        self._handler = handler
        self.plan = plan
        self.this_node = repr(handler._this_node)
        self.round_nodes = self._participants()
        self._alive = self.round_nodes  #: the nodes the last answered read held a heartbeat for
        self._read: _Read | None = None
        self._unanswered_since: float | None = None  #: start of the first read since the store last answered

    @classmethod
    def for_round(cls, handler: Any, plan: PeerPlan) -> PeerWatch | None:
        """A watch over ``handler``'s current round; ``None`` for a handler without torch's heartbeats (static)."""
        if not all(hasattr(handler, a) for a in ("_this_node", "_state_holder", "_heartbeat_lock")):
            return None
        return cls(handler, plan)

    def _participants(self) -> frozenset[str]:
        """The round's participants, as the rendezvous that just completed left them in the state holder."""
        lock = self._handler._heartbeat_lock
        locked = lock.acquire(timeout=self.plan.timeout_s)
        try:
            return frozenset(repr(n) for n in self._handler._state_holder.state.participants)
        finally:
            if locked:
                lock.release()

    def check(self, now: Callable[[], float] = time.monotonic) -> Liveness:
        """Read the state (torch's holder serves it from a 1 s cache) and judge it.

        Where the store lives in a peer (c10d), the read is waited for until the store has been silent for the peer
        timeout, so the torch calls that follow in the same tick (``num_nodes_waiting``) find it answering.
        """
        if self._read is None:
            self._start_read(now())
        read, since = self._read, self._unanswered_since
        assert read is not None and since is not None
        if self.plan.store_in_agent is not None:
            read.done.wait(max(0.0, since + self.plan.timeout_s - now()) + 0.05)
        if read.done.is_set():
            self._read = None
            if read.alive is not None:
                self._alive, self._unanswered_since = read.alive, None
        wait = 0.0 if self._unanswered_since is None else now() - self._unanswered_since
        snap = Snapshot(self.this_node, self.round_nodes, self._alive, wait)
        return judge(snap, self.plan.timeout_s, self.plan.store_in_agent is not None)

    def _start_read(self, t: float) -> None:
        self._read = _Read()
        if self._unanswered_since is None:
            self._unanswered_since = t
        args = (self._handler, self._read)
        threading.Thread(target=_read_state, args=args, name="elasticzero-peer-read", daemon=True).start()


def _read_state(handler: Any, read: _Read) -> None:
    """In a daemon thread: sync torch's state holder (it drops the silent nodes) and note who is still there."""
    try:
        with handler._heartbeat_lock:
            handler._state_holder.sync()
            read.alive = frozenset(repr(n) for n in handler._state_holder.state.last_heartbeats)
    except Exception:  # a store error is no answer: the store's silence keeps growing
        pass
    finally:
        read.done.set()


def peer_change(watch: PeerWatch | None) -> PeerChange | None:
    """Check ``watch``; what to do about its verdict (``None``: nothing). Raises :class:`StoreLostError`."""
    if watch is None:
        return None
    verdict = watch.check()
    if verdict.alive:
        return None
    if verdict.store_silent_s is not None:
        raise StoreLostError(store_lost_line(watch.plan, verdict.store_silent_s))
    if verdict.self_gone:
        why = (
            f"this node was dropped from the rendezvous (no heartbeat for {watch.plan.timeout_s} s: it was frozen "
            "or cut off) and the others went on without it; stopping its workers and joining again as a new node"
        )
        return PeerChange(why, mark=False)
    return PeerChange(gone_line(verdict.gone, watch.plan), mark=True)
