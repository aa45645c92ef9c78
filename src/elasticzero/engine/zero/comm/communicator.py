"""The :class:`Communicator`: issues, counts and settles one engine object's collectives on one process group."""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticzero.engine.zero import ring
from elasticzero.engine.zero.comm.backends import p2p_batched, ring_applies, settles
from elasticzero.engine.zero.comm.patching import unpin_default_group
from elasticzero.engine.zero.comm.stats import CommStats
from elasticzero.engine.zero.comm.work import AnyWork, LocalWork, PendingWork, WaitedWork, Waiter, forget
from elasticzero.errors import UsageError
from elasticzero.progress import Reporter, reporter

# torch >= 2.13 renamed the single-tensor collectives (the old names warn); use whichever exists.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SETTLE_TIMEOUT_S = 10.0
_P2P_TAG = 7  # point-to-point exchanges (rings use tags from ring.message_tag, >= 2^20)


class Communicator:
    """Issues, counts and settles one engine object's collectives on one process group.

    Args:
        group: the process group (None: the default group, resolved now). Held weakly: a communicator never keeps a
            destroyed group — and its gloo worker threads — alive past ``dist.destroy_process_group()``. Kept
            alive, those threads drop their last references to the tensors of the final collectives after the script
            returns and may need the GIL while the interpreter finalizes, which aborts the process ("terminate called
            without an active exception", exit -6). With a weak reference, ``destroy_process_group()`` joins them.
        owner: the engine object's name, for error messages.
        stats: the :class:`CommStats` to count into (default: new ones); ``communicator.stats`` either way.
        waiter: how every wait of this communicator's works blocks (:data:`Waiter`; default: ``work.wait()``).

    Attributes:
        rank, size: this process's rank in the group and the group's size, when built.
        backend: the group's backend name.
        uses_ring: whether CPU reduce-scatters and all-gathers run as :mod:`.ring` rings (decided here, once, so every
            collective of this communicator takes the same path; ``ELASTICZERO_GLOO_RING=0`` when it is built turns
            them off).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        owner: str = "Communicator",
        stats: CommStats | None = None,
        waiter: Waiter | None = None,
    ) -> None:
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise UsageError(f"{owner} needs torch.distributed initialised (init_process_group)")
        if pg is dist.GroupMember.NON_GROUP_MEMBER:
            raise UsageError(f"{owner}: this process is not in the group (new_group gave it NON_GROUP_MEMBER)")
        self.owner = owner
        self.waiter = waiter
        self.stats = stats if stats is not None else CommStats()
        self.rank: int = dist.get_rank(pg)
        self.size: int = dist.get_world_size(pg)
        self.backend = str(dist.get_backend(pg))
        self.uses_ring = ring_applies(self.backend, self.size, os.environ.get("ELASTICZERO_GLOO_RING"))
        self._ref: weakref.ref[Any] | None = weakref.ref(pg)
        self._pending: list[AnyWork] = []  # asynchronous collectives issued, not known to be complete
        # Aliases of tensors whose collective completed but whose backend thread may still hold them (see settle)
        self._settling: list[torch.Tensor] = []
        self._rings = 0  # ring collectives issued: their message tags (every rank issues the same sequence)
        self._progress = reporter()  # the worker's progress record: collectives numbered, waits marked
        if pg is dist.group.WORLD:
            # The one place the engine calls it. The default group is the one torch's default arguments pin (see
            # .patching), so it is unpinned where the engine starts to use it: when the engine was imported after
            # init_process_group, that import has pinned it by now, and unpinned, destroy_process_group() joins the
            # threads that will carry this communicator's collectives. Subgroups are never pinned.
            unpin_default_group()

    @property
    def group(self) -> Any:
        """The process group; a :class:`UsageError` once it was destroyed or this communicator was closed."""
        if self._ref is None:
            raise UsageError(
                f"the communicator of this {self.owner} was closed; give it a new one (.communicator = "
                "Communicator(group))"
            )
        pg = self._ref()
        if pg is None:
            raise UsageError(
                f"the process group of this {self.owner} was destroyed (destroy_process_group); give it a "
                f"communicator on the new group (.communicator = Communicator(group)) or build a new {self.owner}"
            )
        return pg

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._ref is None

    @property
    def pending(self) -> int:
        """Asynchronous collectives issued and not yet waited for."""
        return sum(not w.done for w in self._pending)

    @property
    def unsettled(self) -> int:
        """Tensors of completed collectives the backend may still hold (0 after :meth:`settle`)."""
        return len(self._settling)

    def close(self) -> None:
        """Complete every collective still pending, settle, and detach from the group (idempotent).

        Detached even when completing raises (a failed group's error propagates); any later collective raises a
        :class:`UsageError`.
        """
        try:
            for w in self._pending:
                w.wait()
            self.settle()
        finally:
            self._pending = []
            self._ref = None

    # -- collectives ----------------------------------------------------------------------------------------------
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "grad", async_op: bool = False
    ) -> AnyWork | None:
        """Sum ``input`` (``size * output.numel()`` elements) over ranks; this rank's chunk lands in ``output``."""
        pg = self.group
        self.stats.record("reduce_scatter", tag, input)
        if self.size == 1:
            return self._finish(LocalWork(output, input), async_op)
        if self._ring_for(input):
            work = ring.reduce_scatter(output, input, pg, self._ring_tag(), self._settling.extend, self._mark())
            return self._finish(work, async_op)
        return self._issue(_reduce_scatter, (output, input), async_op, op=dist.ReduceOp.SUM, group=pg)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, tag: str = "param", async_op: bool = False
    ) -> AnyWork | None:
        """Concatenate every rank's ``input`` into ``output`` (``input`` may be this rank's chunk of ``output``)."""
        pg = self.group
        self.stats.record("all_gather", tag, output)
        if self.size == 1:
            return self._finish(LocalWork(output, input), async_op)
        if self._ring_for(output):
            work = ring.all_gather(output, input, pg, self._ring_tag(), self._settling.extend, self._mark())
            return self._finish(work, async_op)
        return self._issue(_all_gather, (output, input), async_op, group=pg)

    def all_reduce(
        self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM, tag: str = "grad", async_op: bool = False
    ) -> AnyWork | None:
        """Reduce ``tensor`` in place over ranks with ``op`` (SUM by default)."""
        pg = self.group
        self.stats.record("all_reduce", tag, tensor)
        return self._issue(dist.all_reduce, (tensor,), async_op, op=op, group=pg)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int, *, tag: str = "init") -> None:
        """Copy ``tensor`` from group rank ``src_group_rank`` to every rank (tag ``"init"``)."""
        pg = self.group
        self.stats.record("broadcast", tag, tensor)
        self._issue(dist.broadcast, (tensor,), False, group=pg, group_src=src_group_rank)

    def all_gather_object(self, obj: Any, *, tag: str = "reshard") -> list[Any]:
        """Every rank's picklable ``obj``, in group-rank order (small metadata: a reshard's census). Counted as a
        call of ``all_gather_object`` (its bytes are the pickles', not counted). Blocking; with a ``waiter`` it runs
        inside it, bounded like every wait of this communicator (a live round's: a member frozen before it arrives
        is left for the next round — unbounded, the reshard's agreement waited for it for good)."""
        out: list[Any] = [None] * self.size
        group = self.group

        def gather() -> None:
            dist.all_gather_object(out, obj, group=group)

        if self.waiter is not None:
            self.waiter(gather)
        else:
            gather()
        self.stats.calls[("all_gather_object", tag)] += 1
        return out

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        *,
        tag: str = "copies",
        async_op: bool = False,
    ) -> AnyWork | None:
        """Point-to-point: send each ``(tensor, group_rank)`` of ``sends`` and receive into each of ``recvs`` (every
        peer posts the matching calls in the same order; messages between two ranks match in posting order). Counted
        as ``send:<tag>`` / ``recv:<tag>``. Where gloo serves the tensors, each is its own ``isend``/``irecv``;
        elsewhere (NCCL) they are posted as one batch (:func:`p2p_batched`)."""
        pg = self.group
        ops = [(dist.isend, t, r) for t, r in sends] + [(dist.irecv, t, r) for t, r in recvs]
        for fn, t, _ in ops:
            self.stats.record("send" if fn is dist.isend else "recv", tag, t)
        gloo = bool(ops) and settles(self.backend, ops[0][1].device.type)
        retire = self._settling.extend if gloo else forget

        def post() -> list[Any]:  # fresh aliases, known only to the work (see settle)
            aliased = [(fn, t.detach(), dist.get_global_rank(pg, r)) for fn, t, r in ops]
            if aliased and p2p_batched(self.backend, aliased[0][1].device.type):
                p2p = [dist.P2POp(fn, a, peer, group=pg, tag=_P2P_TAG) for fn, a, peer in aliased]
                return [(work, aliased[0][1]) for work in dist.batch_isend_irecv(p2p)]
            return [(fn(a, peer, group=pg, tag=_P2P_TAG), a) for fn, a, peer in aliased]

        return self._finish(ring.RingWork([post], retire), async_op)

    def settle(self, timeout: float = _SETTLE_TIMEOUT_S) -> None:
        """Return once the backend's threads have let go of every tensor of every collective of this communicator
        waited for so far.

        Why: a gloo worker releases its work a moment *after* completing it; each release of a tensor the Python side
        also knows needs the GIL (torch >= 2.10 refcounts the PyObject from C++, and the work's thread-local state
        holds Python objects too). If the script ends in that moment — an optimizer's step is often the last
        collective — the worker asks for the GIL while the interpreter finalizes, is ended by pthread_exit inside a
        noexcept destructor, and the process aborts ("terminate called without an active exception", exit -6).
        Collectives get fresh aliases known only to this communicator, so "the backend let go" is observable: the
        alias's refcount falls to the references held here.

        Called by the engine at the end of each phase that issued collectives (a bucketer's end of backward, a ZeRO
        ``step``), so no backend thread is still releasing engine tensors when control returns to the training
        script — which may end right then. Collectives still in flight are not waited for. Normally returns at once;
        polls (releasing the GIL) for at most ``timeout`` seconds, then stops tracking what is left rather than hang.
        """
        deadline = 0.0
        while self._settling:
            # references to the alias: the list slot and getrefcount's argument; a backend holder adds one
            if sys.getrefcount(self._settling[-1]) <= 2:
                self._settling.pop()
                continue
            now = time.monotonic()
            if not deadline:
                deadline = now + timeout
            elif now > deadline:
                warnings.warn(
                    f"elasticzero: {len(self._settling)} collective tensor(s) of a {self.owner} still held by the "
                    f"backend after {timeout:.0f} s; no longer waiting for them",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._settling.clear()
                return
            time.sleep(1e-4)

    # -- internals --------------------------------------------------------------------------------------------------
    def _ring_for(self, tensor: torch.Tensor) -> bool:
        return self.uses_ring and tensor.device.type == "cpu"

    def _ring_tag(self) -> int:
        n, self._rings = self._rings, self._rings + 1
        return ring.message_tag(n)

    def _mark(self) -> tuple[Reporter, int]:
        """The progress record and the number of the collective being issued (for its wait)."""
        return self._progress, self._progress.issued()

    def _issue(self, fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], async_op: bool, **kwargs: Any) -> Any:
        aliases = tuple(t.detach() for t in tensors)
        retire = self._settling.extend if settles(self.backend, tensors[0].device.type) else forget
        work = PendingWork(fn(*aliases, async_op=True, **kwargs), aliases, retire, *self._mark())
        del aliases  # from here on only the work (then the settle list) refers to them
        return self._finish(work, async_op)

    def _finish(self, work: AnyWork, async_op: bool) -> AnyWork | None:
        """The work itself when asynchronous (tracked until done); otherwise wait for it, settle, and return None."""
        if self.waiter is not None:
            work = WaitedWork(work, self.waiter)
        if async_op:
            self._pending = [w for w in self._pending if not w.done]
            if not work.done:
                self._pending.append(work)
            return work
        work.wait()
        self.settle()
        return None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"rank {self.rank} of {self.size}, {self.backend}"
        return f"Communicator({self.owner}: {state}{', ring' if self.uses_ring else ''})"


def check_replacement(current: Communicator, new: Communicator, owner: str) -> None:
    """A :class:`UsageError` unless ``new`` may take over from ``current`` in ``owner``: open, and this process has
    the same rank in a group of the same size (the object's buckets and shards are laid out for them)."""
    if new.closed:
        raise UsageError(f"{owner}: the new communicator is closed; open one on the new group")
    if (new.rank, new.size) != (current.rank, current.size):
        raise UsageError(
            f"{owner} is laid out for rank {current.rank} of {current.size}; the new communicator's group has this "
            f"process as rank {new.rank} of {new.size}: build a new {owner} (or load a checkpoint) for another world"
        )


class OwnsCommunicator:
    """An engine object whose collectives one :class:`Communicator` issues (``self._communicator``, set by the
    object's constructor): its ``communicator``, ``process_group`` and ``comm_stats``, written once for every such
    object (a ZeRO optimizer, a bucketer, a BuddyCopies)."""

    _communicator: Communicator

    @property
    def process_group(self) -> Any:
        """The group (held weakly: a :class:`UsageError` once it was destroyed)."""
        return self._communicator.group

    @property
    def communicator(self) -> Communicator:
        """Issues, counts and settles this object's collectives."""
        return self._communicator

    @communicator.setter
    def communicator(self, new: Communicator) -> None:
        """Replace it by ``new`` (a group of the same ranks, e.g. rebuilt in this process); the old one is closed
        first (:meth:`Communicator.close`: if its group failed, close it yourself and handle the error, then
        assign). What shares it follows (:meth:`_communicator_replaced`)."""
        check_replacement(self._communicator, new, type(self).__name__)
        self._communicator.close()
        self._communicator = new
        self._communicator_replaced(new)

    def _communicator_replaced(self, new: Communicator) -> None:
        """Hand ``new`` on to the objects sharing the communicator (a ZeRO optimizer: its bucketer)."""

    @property
    def comm_stats(self) -> CommStats:
        """Counters of this object's collectives (its communicator's)."""
        return self._communicator.stats
