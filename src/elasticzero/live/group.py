"""Forming a round's process group: every round, the first one too, is a fresh *default* group on the round's store.

Why a fresh default group and not ``dist.new_group``: a joining process is not in the old default group, and torch
names a subgroup by its members' hash, so the same members cannot form a group twice in one process. A default group
is formed by whoever the round names, on ``PrefixStore(round.prefix, TCPStore(round.store))`` (a prefix no other
round uses), at the round's world size.

:func:`group_spec` is the decision, pure over the round, this process's local rank and its :class:`Placement` (the
one device rule, :mod:`elasticzero.device`): backend, new rank, world size, store, device, timeout;
:func:`init_args` turns it into ``init_process_group``'s arguments.
:func:`abandon_calls` is how the previous group is left: gloo ``destroy_process_group`` (torch calls the backend's
``shutdown``; it returns at once even with a thread stuck in a collective, as long as the group object stays
referenced, so its destructor never joins that thread); NCCL ``abort`` first (``ncclCommAbort`` on every
communicator: a kernel stuck on a lost peer is torn down, where ``shutdown`` alone would wait for it), then
``destroy_process_group`` to drop torch's registry. :class:`RoundGroups` is the thin I/O around both; it keeps every
abandoned group (and every store) referenced — the object that owns the rounds owns them, no module state — until a
gloo group's connections are cut (below), when it lets the group go.

Switching is gated (:meth:`RoundGroups.ready`, the round protocol's *ready* step): a member of the old round reads
the new round, says it is ready under the new round's prefix and keeps training in the old group until every member
said so — a joiner's worker says so once it started and reached the round's formation. A join then pauses the old
members for the formation, build and reshard alone, not for the joiner's cold start; and when the members switch is
decided once, by the first to find every key set (:meth:`RoundGroups.switch_at`, the *switch* step): at once, or —
where every old member is in the new round — at a step boundary they all reach, so none leaves a step it began.

The group's connections are watched (gloo): the sockets ``init_process_group`` opened are recorded, and
:meth:`RoundGroups.lost` says whether one of them closed since — gloo closes a pair's socket when its peer dies, even
where a wait on that peer never fails (a receive whose sender died mid-message), so a bounded wait that lasts asks
(:class:`~elasticzero.live.bounded.BoundedWait`'s ``lost``). :func:`socket_fds` is the I/O (``/proc/self/fd``),
:func:`closed` the decision.

A group left is cut once the next round settled (:meth:`RoundGroups.cut_left`, :func:`cut`): gloo cannot abort an
operation — its ``abort`` and ``shutdown`` leave a pending one pending, holding its tensors and its waiting thread
until the group's timeout (minutes) — so its recorded connections are shut down instead, once every member of the new
round formed the new group (none uses the old one any more): the pending operations fail at once, as on a dead peer's
connection, and let go of both.

Forming is leavable: ``init_process_group`` waits for every member without a bound but the group's timeout (minutes),
so a member lost before it arrives — a joiner killed while its interpreter starts, a node frozen between two rounds —
would hold the others there. :meth:`RoundGroups.form` first connects to the round's store once it listens
(:func:`listening`, probed between two calls of ``check``), then waits for every member's arrival key under the
round's prefix (:func:`arrive`), calling ``check`` between two polls:
the live loop's bound, which leaves with the newer round the agents write once they noticed the loss. Only members
that all arrived a moment ago then enter ``init_process_group``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elasticzero.device import Placement
from elasticzero.live.bounded import LiveError
from elasticzero.rounds import NEW_MEMBER, SWITCH_KEY, NodeRound, arrival_key, ready_key

#: the store's wait bound when the round gives no timeout (torch's TCPStore default)
_STORE_TIMEOUT = timedelta(minutes=5)
#: one try at connecting to a round's store (its host may still be starting: a joiner that is the new rank 0)
_CONNECT_TRY = timedelta(seconds=1)
#: how often a member waiting for the others' arrival polls the store (and calls ``check``)
_ARRIVAL_POLL_S = 0.02
#: how long a plain probe of the round's store port waits for the connection
_PROBE_S = 0.2

Check = Callable[[], None]


def arrive(store: Any, rank: int, world_size: int, check: Check, poll_s: float = _ARRIVAL_POLL_S) -> None:
    """Set this member's arrival key on ``store`` (the round's prefixed store) and wait until every member's is set,
    calling ``check`` (it raises to leave: a newer round) between two polls."""
    store.set(arrival_key(rank), "1")
    keys = [arrival_key(r) for r in range(world_size)]
    while not store.check(keys):
        check()
        time.sleep(poll_s)


@dataclass(frozen=True)
class GroupSpec:
    """How this process forms a round's default group: ``init_process_group(backend, store=PrefixStore(prefix,
    TCPStore(host, port, is_master=store_master)), rank, world_size, timeout, device_id=device)``."""

    backend: str
    rank: int
    world_size: int
    host: str
    port: int
    store_master: bool
    prefix: str
    device: str | None
    timeout: timedelta | None


def group_spec(round_: NodeRound, local_rank: int, where: Placement, timeout: timedelta | None = None) -> GroupSpec:
    """This process's part in ``round_``'s group (``timeout`` wins over the placement's, the launcher's collective
    timeout; neither: torch's default); a :class:`LiveError` when the round does not name this local rank."""
    rank = round_.rank_of(local_rank)
    if rank is None:
        raise LiveError(f"local rank {local_rank} is not in round {round_.number} (its ranks: {dict(round_.ranks)})")
    s = round_.store
    limit = timeout if timeout is not None else where.timeout
    master = s.rank0_hosts and rank == 0
    return GroupSpec(
        where.backend, rank, round_.world_size, s.host, s.port, master, round_.prefix, where.bound_device, limit
    )


def init_args(spec: GroupSpec) -> dict[str, Any]:
    """``init_process_group``'s arguments but the store: NCCL bound to its device (``device_id``: the communicator is
    created eagerly on it, no collective guesses a device), none on the CPU; ``timeout`` None: torch's default."""
    device = torch.device(spec.device) if spec.device is not None else None
    return {
        "backend": spec.backend,
        "rank": spec.rank,
        "world_size": spec.world_size,
        "timeout": spec.timeout,
        "device_id": device,
    }


def abandon_calls(backend: str, *, aborted: bool = False) -> tuple[str, ...]:
    """What leaving a group of ``backend`` calls, in order: ``"abort"`` (``ProcessGroup.abort``) for NCCL unless a
    :class:`RoundWatch` ``aborted`` it already, then ``"destroy"`` (``destroy_process_group``) for every backend (see
    the module)."""
    return ("abort", "destroy") if backend == "nccl" and not aborted else ("destroy",)


def aborts_on_announce(backend: str) -> bool:
    """Whether a group of ``backend`` is aborted from a watch thread as soon as a newer round is announced: NCCL,
    whose ``work.wait()`` only makes the stream wait (``TORCH_NCCL_BLOCKING_WAIT`` off), so a
    :class:`~elasticzero.live.bounded.BoundedWait` returns at once and a collective stuck on a lost peer blocks the
    next host-device sync (a loss's ``.item()``) unbounded; the abort tears the kernel down and that sync raises,
    which the attempt takes to the new round. gloo's waits block the host: the bound leaves them."""
    return backend == "nccl"


class RoundWatch:
    """Polls ``poll`` (the round file's decision for the current round) every ``poll_s`` on a daemon thread; at the
    first answer that is not ``None`` (a newer round, or a file that is not a round) calls ``on_announce()`` once and
    ends. :meth:`close` ends it earlier; once it returned, :attr:`fired` is final (the two never interleave)."""

    def __init__(self, poll: Callable[[], object], on_announce: Callable[[], None], poll_s: float = 0.05) -> None:
        self._poll, self._on_announce, self._poll_s = poll, on_announce, poll_s
        self._lock = threading.Lock()
        self._stopped = False
        self.fired = False
        threading.Thread(target=self._run, name="ez-round-watch", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self._poll_s)
            announced = self._poll() is not None
            with self._lock:
                if self._stopped:
                    return
                if announced:
                    self.fired = True
                    self._on_announce()
                    return

    def close(self) -> None:
        with self._lock:
            self._stopped = True


class RoundGroups:
    """Forms each round's default group in this process; keeps every abandoned group and every store referenced."""

    def __init__(self) -> None:
        self.current: Any = None  #: the default group this object formed last (None before the first)
        self.abandoned: list[Any] = []  #: the groups left and kept (see the module); a cut gloo group is let go
        self._stores: dict[tuple[str, int], Any] = {}  #: one client (or server) per store address, reused
        self._lock = threading.Lock()  #: the stores are reached from a round watch's thread too (NCCL)
        #: the current group's connections (gloo), as :func:`socket_fds` saw them once it formed; none while forming
        self.sockets: dict[int, str] = {}
        #: the groups left since the last :meth:`cut_left` whose connections were recorded (gloo), with them
        self._left: list[tuple[Any, dict[int, str]]] = []
        self._cut: list[Any] = []  #: the groups cut and not yet let go (:meth:`let_go`)

    def form(
        self, spec: GroupSpec, *, ready: str = NEW_MEMBER, aborted: bool = False, check: Check = lambda: None
    ) -> Any:
        """Leave the current group (``aborted``: a :class:`RoundWatch` already aborted it), form ``spec``'s once
        every member arrived (``check`` between two polls: it raises to leave, see the module); returns the new
        default group. ``ready``: this process's ready value (:func:`~elasticzero.rounds.ready_value`)."""
        self.abandon(aborted=aborted)
        store = dist.PrefixStore(spec.prefix, self._store(spec, check))
        store.set(ready_key(spec.rank), ready)  # a fresh process: it started (an old round's member said so already)
        arrive(store, spec.rank, spec.world_size, check)
        before = socket_fds()
        dist.init_process_group(store=store, **init_args(spec))
        self.current = dist.group.WORLD
        if spec.backend == "gloo":
            self.sockets = {fd: link for fd, link in socket_fds().items() if before.get(fd) != link}
        return self.current

    def lost(self) -> bool:
        """Whether a connection of the current group closed since it formed (see the module)."""
        return closed(self.sockets, socket_fds()) if self.sockets else False

    def abandon(self, *, aborted: bool = False) -> None:
        """Leave the group formed last (aborted — unless ``aborted`` already — and destroyed, kept referenced);
        nothing when there is none."""
        pg, self.current = self.current, None
        left, self.sockets = self.sockets, {}  # its connections close now: no sign of a lost peer
        if pg is None:
            return
        self.abandoned.append(pg)
        if left:
            self._left.append((pg, left))
        for call in abandon_calls(str(dist.get_backend(pg)), aborted=aborted):
            if call == "abort":
                pg.abort()
            else:
                dist.destroy_process_group(pg)

    def cut_left(self) -> int:
        """Shut down the connections of every group left since the last call (gloo; :func:`cut`); how many. Call it
        once every member of the current round formed its group — none of them uses an older one any more — and
        :meth:`let_go` of them later.

        gloo cannot abort an operation (its ``abort`` and ``shutdown`` leave a pending one pending): a collective or
        transfer left pending in an abandoned group — its peer lost, or left for the new round — would hold its
        tensors (the old round's buffers) and its waiting thread until the group's timeout (minutes). Shut down, its
        connections fail it at once, as a dead peer's would."""
        left, self._left = self._left, []
        done = sum(cut(sockets) for _, sockets in left)
        self._cut += [pg for pg, _ in left]
        return done

    def let_go(self) -> None:
        """Drop the groups cut so far, on a thread of their own (:func:`_let_go`). A gloo group kept holds its threads
        and their heaps — ~325 MB per round change at 25.5M parameters, measured over 12 round changes of two live
        ranks; its destructor joins those threads (50-100 ms with the interpreter's lock held, which is why the live
        loop calls this after the new round's first step, not in the round change), and a pending operation the cut
        did not reach would keep it waiting: then only that thread waits."""
        groups, self._cut = self._cut, []
        self.abandoned = [pg for pg in self.abandoned if not any(pg is g for g in groups)]
        if groups:
            _let_go(groups)  # the groups' only references here were in ``groups``, which the thread empties

    def ready(self, spec: GroupSpec, value: str) -> list[str] | None:
        """Say this member is ready to switch to ``spec``'s round (``value``: :func:`~elasticzero.rounds.ready_value`);
        once every member is (see the module), every member's value by rank, else None. Never waits for a store that
        is not listening yet (its host, the round's new rank 0, may be a joiner starting)."""
        store = self._store_now(spec)
        if store is None:
            return None
        prefixed = dist.PrefixStore(spec.prefix, store)
        prefixed.set(ready_key(spec.rank), value)
        return self.ready_values(spec) if prefixed.check([ready_key(r) for r in range(spec.world_size)]) else None

    def ready_values(self, spec: GroupSpec) -> list[str]:
        """Every member's ready value (:func:`~elasticzero.rounds.ready_value`) by rank, once every key is set (the
        round's group formed: every member set its key before it arrived)."""
        store = dist.PrefixStore(spec.prefix, self._store_now(spec))
        return [raw.decode(errors="replace") for raw in store.multi_get([ready_key(r) for r in range(spec.world_size)])]

    def switch_at(self, spec: GroupSpec, proposal: int | None) -> int | None:
        """The members' decision of when the old round's members switch to ``spec``'s round
        (:data:`~elasticzero.rounds.SWITCH_KEY` under its prefix: :data:`~elasticzero.rounds.AT_ONCE` or a step):
        ``proposal`` compare-set unless one is there (the first wins); None without a proposal when none is there
        yet. Call it once every member is ready (the store listens)."""
        store = dist.PrefixStore(spec.prefix, self._store_now(spec))
        if proposal is None:
            return int(store.get(SWITCH_KEY)) if store.check([SWITCH_KEY]) else None
        return int(store.compare_set(SWITCH_KEY, "", str(proposal)))

    def _store(self, spec: GroupSpec, check: Check) -> Any:
        """The store at ``spec``'s address: the one this process already has there, else a new client (or server,
        when the round's new rank 0 hosts it); a client connects in tries of :data:`_CONNECT_TRY`, ``check`` between
        two (the host may be a joiner still starting, or lost)."""
        while (store := self._store_now(spec)) is None:
            check()
            time.sleep(_ARRIVAL_POLL_S)
        return store

    def _store_now(self, spec: GroupSpec) -> Any:
        """The store at ``spec``'s address if this process has it or can have it at once (served here, or one try of
        a client at a port that listens), else None."""
        key = (spec.host, spec.port)
        with self._lock:
            if key not in self._stores:
                limit = spec.timeout if spec.timeout is not None else _STORE_TIMEOUT
                store = self._serve(spec, limit) if spec.store_master else _try_connect(spec)
                if store is None:
                    return None
                store.set_timeout(limit)
                self._stores[key] = store
            return self._stores[key]

    @staticmethod
    def _serve(spec: GroupSpec, limit: timedelta) -> Any:
        return dist.TCPStore(spec.host, spec.port, is_master=True, timeout=limit, wait_for_workers=False)


def socket_fds() -> dict[int, str]:
    """This process's open sockets: descriptor -> its link (``socket:[inode]``); empty without ``/proc``."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def _let_go(groups: list[Any]) -> None:
    """On a daemon thread: drop the last references to ``groups`` (the caller keeps none: their destructors run
    there), collect the cycles the round left behind (the old optimizer's, and those that keep a group), and give the
    heap's free pages back (:func:`trim_heap`)."""

    def run() -> None:
        groups.clear()
        gc.collect()
        trim_heap()

    threading.Thread(target=run, name="elasticzero-let-go", daemon=True).start()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None under another C library


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``; nothing under another C library).
    Each round change frees one set of buffers and allocates another; glibc serves allocations below its dynamic
    mmap threshold (up to 32 MB) from its heaps and keeps what they free there, fragmented: a world-of-one loop at
    25.5M parameters grew ~115 MB per round change (735 -> 2348 MB over 14), flat with this (~20 ms a call)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def cut(recorded: Mapping[int, str]) -> int:
    """Shut down (both directions) each connection of ``recorded`` (descriptor -> link, :func:`socket_fds`) that is
    still open as recorded; how many. Each is reached through a duplicate of its descriptor, checked to be the very
    socket recorded (its ``socket:[inode]``): a descriptor closed and reused for another socket meanwhile is left
    alone. A listening socket is left alone too: gloo's listener thread treats a failed ``accept`` as fatal (it
    terminates the process)."""
    done = 0
    for fd, link in recorded.items():
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            continue
        if _link(dup) != link:  # closed, its number reused (by a file, another socket): not ours to touch
            os.close(dup)
            continue
        with socket.socket(fileno=dup) as sock:  # closes the duplicate only
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # already shut down, or not connected any more
                pass
    return done


def _link(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def closed(recorded: Mapping[int, str], now: Mapping[int, str]) -> bool:
    """Whether a socket of ``recorded`` is not open as it was (closed; its descriptor free or reused)."""
    return any(now.get(fd) != link for fd, link in recorded.items())


def _try_connect(spec: GroupSpec) -> Any:
    """One try of a client of ``spec``'s store (None: nothing listens there, or it went away meanwhile)."""
    if not listening(spec.host, spec.port):
        return None
    try:
        return dist.TCPStore(spec.host, spec.port, is_master=False, timeout=_CONNECT_TRY)
    except RuntimeError:  # DistNetworkError / DistStoreError: gone between the probe and the client
        return None


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port``: a plain probe first, because every failed try of a
    TCPStore client logs a C++ error and stack (a joiner that hosts the round's store takes seconds to start)."""
    try:
        socket.create_connection((host, port), timeout=_PROBE_S).close()
    except OSError:
        return False
    return True
