"""Thin I/O of peer liveness: read the rendezvous state into a :class:`~elasticzero.agent.liveness.Snapshot`.

The state is torch's (``DynamicRendezvousHandler``): fetched from its backend under the handler's heartbeat lock (the
lock torch's keep-alive thread and ``num_nodes_waiting`` hold around their reads), so it never races them; fetched
fresh each time, not through the state holder's one-second cache, so a frozen node is seen at the peer timeout,
not up to a second later. The read runs in a daemon thread and
the monitor loop never waits for it: a store that does not answer (c10d: its host is frozen, and torch's keep-alive
thread holds the lock while it waits) shows as a growing ``store_wait_s`` instead of a blocked agent.

The same read looks for a failed collective's ask in the rendezvous round's store (:mod:`elasticzero.agent.suspicion`):
who asked, and — while this node is the asker — which nodes answered. :func:`drop_nodes` is the ask's one write to
torch's state: the silent nodes' heartbeats expired, in one compare-and-set.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elasticzero.agent.liveness import Liveness, PeerPlan, Snapshot, judge, silent, store_lost_line
from elasticzero.agent.suspicion import ASK_KEY, Asked, answer_key, ask_timeout_s, expire, may_drop
from elasticzero.agent.tick import Suspicion

#: etcd: seconds between two reads of the state (one small range request per agent each); c10d reads every monitor
#: tick, since the read is also the probe that keeps the tick from blocking on a store whose host froze
READ_PERIOD_S = 0.5
#: torch's c10d rendezvous port when the endpoint names none (``c10d_rendezvous_backend``)
C10D_DEFAULT_PORT = 29400


def hosts_store(store: str | None) -> bool:
    """Whether this process hosts the c10d store at ``store`` (``host:port``): it listens on that port. Such a store
    is no peer's: a read of it left unanswered for the peer timeout means this process itself was starved of CPU (or
    stopped), never that the node hosting it froze — judged so, a starved single-node job would stop itself."""
    if store is None:
        return False
    _, port = parse_rendezvous_endpoint(store, default_port=C10D_DEFAULT_PORT)
    proc = psutil.Process()
    listing = getattr(proc, "net_connections", None) or proc.connections  # psutil >= 6 renamed it
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in listing(kind="tcp"))


def state_read_period_s(plan: PeerPlan, monitor_interval_s: float) -> float:
    """How often this agent reads the rendezvous state: every monitor tick where the store lives in an agent (c10d),
    every :data:`READ_PERIOD_S` otherwise (etcd)."""
    return monitor_interval_s if plan.store_in_agent is not None else READ_PERIOD_S


class StoreLostError(RendezvousConnectionError):
    """The c10d store's host (a peer's agent) has not answered for the peer timeout: this node cannot go on."""


@dataclass
class _Read:
    """One read of the state in flight, and the heartbeats it found (``None``: the store failed)."""

    done: threading.Event = field(default_factory=threading.Event)
    beats: dict[str, float] | None = None
    at: float = 0.0  #: POSIX time of the read
    closed: bool = False  #: the rendezvous is closed (a node gave up, or the job finished)
    asker: str | None = None  #: the node that asked in this rendezvous round (None: nobody, or no store to ask in)
    answered: frozenset[str] = frozenset()  #: the nodes that answered this node's ask


class PeerWatch:
    """Watches the participants of one round (built after each rendezvous; :meth:`check` every monitor tick)."""

    def __init__(self, handler: Any, plan: PeerPlan, store: Any = None, monitor_interval_s: float = 0.1) -> None:
        self._handler = handler
        self.plan = plan
        read_period = state_read_period_s(plan, monitor_interval_s)
        self.ask_timeout_s = ask_timeout_s(monitor_interval_s, read_period)  #: how long this node's asks wait
        self._store = store  #: the rendezvous round's store, where asks and answers live (None: no asks)
        self._asked_at: float | None = None  #: when this node asked (monotonic)
        self._ask: tuple[str | None, frozenset[str]] = (None, frozenset())  #: the last answered read's asker, answers
        #: the store lives in a peer's agent (c10d), not in this process: its silence is that peer's
        self.store_is_a_peer = plan.store_in_agent is not None and not hosts_store(plan.store_in_agent)
        self.this_node = repr(handler._this_node)
        self.round_nodes = self._participants()
        #: the last answered read: heartbeats and when (before the first: everyone just joined, as of now)
        self._beats: Mapping[str, float] = dict.fromkeys(self.round_nodes, time.time())
        self._read_at = time.time()
        self._read: _Read | None = None
        self._unanswered_since: float | None = None  #: start of the first read since the store last answered
        self._next_read = 0.0  #: etcd: the earliest start of the next read (monotonic)
        #: whether the last answered read found the rendezvous closed (None: no read answered yet)
        self.closed: bool | None = None

    @classmethod
    def for_round(
        cls, handler: Any, plan: PeerPlan, store: Any = None, monitor_interval_s: float = 0.1
    ) -> PeerWatch | None:
        """A watch over ``handler``'s current round (``store``: the round's, for asks; ``monitor_interval_s``: how
        often the agents tick); ``None`` for a handler without torch's heartbeats (static)."""
        if not all(hasattr(handler, a) for a in ("_this_node", "_state_holder", "_heartbeat_lock")):
            return None
        if not hasattr(handler._state_holder, "_backend"):
            return None
        return cls(handler, plan, store, monitor_interval_s)

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
        """Read the heartbeats (fresh from the backend) and judge them.

        Where the store lives in a peer (c10d), a read starts every tick and is waited for until the store has been
        silent for the peer timeout, so the store calls that follow in the same tick (``num_nodes_waiting``) find it
        answering. With etcd a read starts every :data:`READ_PERIOD_S` and is never waited for.
        """
        if self._read is None and (self.plan.store_in_agent is not None or now() >= self._next_read):
            self._start_read(now())
        read, since = self._read, self._unanswered_since
        if read is not None and since is not None and self.plan.store_in_agent is not None:
            read.done.wait(max(0.0, since + self.plan.timeout_s - now()) + 0.05)
        if read is not None and read.done.is_set():
            self._read = None
            if read.beats is not None:
                self._beats, self._read_at, self._unanswered_since = read.beats, read.at, None
                self.closed = read.closed
                self._ask = (read.asker, read.answered)
        wait = 0.0 if self._unanswered_since is None else now() - self._unanswered_since
        snap = Snapshot(self.this_node, self.round_nodes, self._beats, self._read_at, wait)
        return judge(snap, self.plan.timeout_s, self.store_is_a_peer)

    def alive(self, dropped: tuple[str, ...] = ()) -> frozenset[str]:
        """The round's nodes the last answered read found alive (torch's rule, :func:`silent`), this node, less
        ``dropped``: whom this node expects in the round a hand-off forms next
        (:func:`~elasticzero.agent.prompt.expect`)."""
        snap = Snapshot(self.this_node, self.round_nodes, self._beats, self._read_at, 0.0)
        found = {n for n in self.round_nodes if not silent(snap, n, self.plan.timeout_s)} | {self.this_node}
        return frozenset(found - set(dropped))

    def suspicion(self, reported: bool, now: Callable[[], float] = time.monotonic) -> Suspicion:
        """The ask's state as the last answered read saw it, with ``reported`` (a local worker's failed collective)."""
        asker, answered = self._ask
        mine = self._asked_at is not None and asker == self.this_node
        asked = Asked(answered, now() - self._asked_at) if mine and self._asked_at is not None else None
        return Suspicion(reported, asker, self.this_node, self.round_nodes, asked, self.ask_timeout_s)

    def ask(self, now: Callable[[], float] = time.monotonic) -> str | None:
        """Ask the round's nodes (first asker wins); the asker now (this node, or who asked first), None: no store."""
        if self._store is None:
            return None
        won = self._store.compare_set(ASK_KEY, "", self.this_node).decode(errors="replace")
        if won == self.this_node and self._asked_at is None:  # asked again before a read saw it: the first counts
            self._asked_at = now()
        return won

    def answer(self) -> None:
        """Answer another node's ask: this node is alive."""
        if self._store is not None:
            self._store.set(answer_key(self.this_node), "1")

    def _start_read(self, t: float) -> None:
        self._read, self._next_read = _Read(), t + READ_PERIOD_S
        if self._unanswered_since is None:
            self._unanswered_since = t
        others = self.round_nodes - {self.this_node} if self._asked_at is not None else frozenset()
        args = (self._handler, self._read, self._store, others)
        threading.Thread(target=_read_state, args=args, name="elasticzero-peer-read", daemon=True).start()


def _read_ask(store: Any, read: _Read, others: frozenset[str]) -> None:
    """Who asked in the round's store, and which of ``others`` answered (this node's ask); nothing without a store."""
    if store is None or not store.check([ASK_KEY]):
        return
    read.asker = store.get(ASK_KEY).decode(errors="replace")
    read.answered = frozenset(n for n in others if store.check([answer_key(n)]))


def drop_nodes(handler: Any, nodes: tuple[str, ...], this_node: str, tries: int = 5) -> bool:
    """Expire ``nodes``' heartbeats in torch's rendezvous state (:func:`~elasticzero.agent.suspicion.expire`), one
    compare-and-set on its backend under the handler's heartbeat lock, retried on a concurrent write; whether it
    landed. Only a participant drops others (:func:`~elasticzero.agent.suspicion.may_drop`): a node that was itself
    dropped meanwhile (frozen, then resumed into a stale view) drops nobody. False also when the nodes were gone
    already, or the state kept changing."""
    backend = handler._state_holder._backend
    with handler._heartbeat_lock:
        for _ in range(tries):
            fetched = backend.get_state()
            if fetched is None:
                return False
            state = pickle.loads(fetched[0])  # the state torch itself pickled there
            if not may_drop(state, this_node) or not expire(state, nodes):
                return False
            result = backend.set_state(pickle.dumps(state), fetched[1])
            if result is not None and result[2]:
                return True
    return False


def _read_state(handler: Any, read: _Read, store: Any = None, others: frozenset[str] = frozenset()) -> None:
    """In a daemon thread: fetch the rendezvous state from its backend and note each node's last heartbeat."""
    try:
        with handler._heartbeat_lock:
            fetched = handler._state_holder._backend.get_state()
            read.at = time.time()
        state = pickle.loads(fetched[0]) if fetched is not None else None  # the state torch itself pickled there
        beats = state.last_heartbeats if state is not None else {}
        read.closed = bool(state is not None and state.closed)
        read.beats = {repr(node): beat.timestamp() for node, beat in beats.items()}
        _read_ask(store, read, others)
    except Exception:  # a store error is no answer: the store's silence keeps growing
        pass
    finally:
        read.done.set()


T = TypeVar("T")


def bounded_call(call: Callable[[], T], timeout_s: float, on_timeout: Callable[[float], Exception]) -> T:
    """``call()`` on a daemon thread, waited ``timeout_s`` at most: its result or exception, else ``on_timeout(s)``
    raised (the thread is left blocked: the caller is giving up on what it waits for)."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:  # handed to the caller, who re-raises it
            done.set_exception(exc)

    start = time.monotonic()
    threading.Thread(target=run, name="elasticzero-bounded-call", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except FutureTimeout:
        raise on_timeout(time.monotonic() - start) from None


class BoundedStoreHandler(RendezvousHandler):
    """torch's rendezvous handler, with the store call torch's monitor loop makes every healthy tick bounded.

    The c10d store lives in one agent. Each tick the agent's :class:`PeerWatch` read answers (or the agent fails with
    :class:`StoreLostError`); right after it, torch's loop calls ``num_nodes_waiting``, an unbounded store read (and
    it waits for the heartbeat lock, which torch's keep-alive thread holds while *its* store call waits). A store host
    lost between the two reads would block that call for torch's 60 s store timeout and end the agent with torch's
    error; bounded here by the peer timeout, it ends with the same one line as the read. Everything else is
    delegated unchanged (attributes too: :class:`PeerWatch` reads torch's handler through this one).
    """

    def __init__(self, handler: RendezvousHandler, plan: PeerPlan) -> None:
        self._inner = handler
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def num_nodes_waiting(self) -> int:
        return bounded_call(self._inner.num_nodes_waiting, self._plan.timeout_s, self._store_lost)

    def _store_lost(self, waited_s: float) -> StoreLostError:
        return StoreLostError(store_lost_line(self._plan, waited_s))

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def bound_store_calls(handler: RendezvousHandler, plan: PeerPlan | None) -> RendezvousHandler:
    """``handler`` with its monitor-tick store call bounded where a peer agent hosts the store (c10d), else itself
    (this process hosting it too: its own store is never lost)."""
    if plan is None or plan.store_in_agent is None or hosts_store(plan.store_in_agent):
        return handler
    return BoundedStoreHandler(handler, plan)
