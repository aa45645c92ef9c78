"""Engine collectives: each engine object issues, counts and settles its collectives through its own
:class:`Communicator`.

A ZeRO optimizer (shared with the :class:`~elasticzero.engine.bucketer.GradBucketer` it drives) and a stand-alone
bucketer each hold one, as ``obj.communicator``; a :class:`~elasticzero.engine.loss_scaler.LossScaler` holds one for the
group it was given, else opens one per agreement on the group it needs. A communicator owns all the state its
collectives need: its process group (held weakly), its :class:`CommStats`, the asynchronous collectives it issued
and has not seen completed, the aliases waiting to be settled (:meth:`Communicator.settle`), the ring decision (made
once, when it is built) and its ring tag sequence. Nothing in this module changes at run time.

:meth:`Communicator.close` completes what is pending, settles and detaches from the group; using it afterwards raises
a :class:`~elasticzero.errors.UsageError`. An engine object's communicator can be replaced by one on another group of
the same ranks (a rebuilt group, in a running process)::

    opt.communicator = Communicator(new_group)      # closes the old one; the optimizer's bucketer follows

Counting: elements are the ``numel`` of the *full* buffer of the collective: the input of a reduce-scatter, the
output of an all-gather, the tensor of an all-reduce or broadcast. So a ZeRO-2 step over Ψ parameters counts Ψ (+ at
most ``world_size - 1`` padding elements per bucket) of ``reduce_scatter`` and as many of ``all_gather``. Every call
carries a ``tag`` saying why it was issued: ``"grad"`` (gradient reduction), ``"param"`` (parameter all-gather),
``"norm"`` (global gradient norm, one scalar), ``"init"`` (one-time broadcast of the initial state), ``"state_dict"``
(:meth:`full_state_dict`), ``"found_inf"`` (the loss scaler's overflow flag), ``"replica"`` (a
:class:`~elasticzero.engine.zero.replica.Replicator`'s buddy copies: ops ``send``/``recv`` of
:meth:`Communicator.exchange`, and the commit gate), ``"reshard"`` (an in-memory reshard). A benchmark counting
traffic per step sums the ``grad`` and ``param`` tags between two :meth:`CommStats.snapshot` calls; stats of several
objects add up with ``+``.

The one effect on the process outside the communicators is :func:`unpin_default_group` (torch's own default
arguments), called where a communicator is opened on the default group; see there.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.nn.functional binds ``group.WORLD`` into its functions' default arguments when it is imported. It
# is imported by torch._dynamo, i.e. by the first torch.optim optimizer a script builds (or by transformers): after
# init_process_group, that pins the default group, so destroy_process_group() no longer joins gloo's threads, and a
# thread still letting go of the last collective's tensors while the interpreter finalizes aborts the process (see
# Communicator.settle). Imported here, with the engine, before the script initialises the group, the defaults bind
# None; when the script initialised the group first, unpin_default_group() puts None back (what the defaults would
# have been).
import torch.distributed.nn.functional  # (see above: imported before the script initialises the group)

from elasticzero.engine.zero import ring
from elasticzero.errors import UsageError
from elasticzero.progress import Reporter, reporter


@dataclass
class CommStats:
    """Counters of collective calls: ``calls[(op, tag)]``, ``elements[(op, tag)]``, ``bytes[(op, tag)]``."""

    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    elements: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)

    def record(self, op: str, tag: str, tensor: torch.Tensor) -> None:
        """Count one call of ``op`` moving the full buffer ``tensor``."""
        key = (op, tag)
        self.calls[key] += 1
        self.elements[key] += tensor.numel()
        self.bytes[key] += tensor.numel() * tensor.element_size()

    def total_elements(self, tags: tuple[str, ...] = ("grad", "param"), ops: tuple[str, ...] | None = None) -> int:
        """Elements moved by calls whose tag is in ``tags`` (and op in ``ops`` when given)."""
        return sum(n for (op, tag), n in self.elements.items() if tag in tags and (ops is None or op in ops))

    def snapshot(self) -> dict[str, int]:
        """A flat copy ``{"op:tag": elements}`` (diff two snapshots to count one step)."""
        return {f"{op}:{tag}": n for (op, tag), n in self.elements.items()}

    def reset(self) -> None:
        """Zero every counter."""
        self.calls.clear()
        self.elements.clear()
        self.bytes.clear()

    def __add__(self, other: CommStats) -> CommStats:
        """New counters holding both (``opt.comm_stats + scaler.comm_stats``; ``sum(stats, CommStats())``)."""
        return CommStats(self.calls + other.calls, self.elements + other.elements, self.bytes + other.bytes)


# torch >= 2.13 renamed the single-tensor collectives (the old names warn); use whichever exists.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SETTLE_TIMEOUT_S = 10.0
_P2P_TAG = 7  # point-to-point exchanges (rings use tags from ring.message_tag, >= 2^20)


def ring_applies(backend: str, world_size: int, setting: str | None) -> bool:
    """Whether reduce-scatter and all-gather of CPU tensors run as :mod:`.ring` point-to-point rings (2-3x faster
    than gloo's own): on gloo with more than one rank, unless ``setting`` (``ELASTICZERO_GLOO_RING``) is ``"0"``."""
    return setting != "0" and "gloo" in backend.lower() and world_size > 1


class PendingWork:
    """An asynchronous collective issued by a :class:`Communicator`; :meth:`wait` completes it (idempotent).

    Holds the ``torch.distributed`` work and the aliases of the tensors handed to it. After the wait the work is
    dropped and the aliases go to the communicator's settle list (see :meth:`Communicator.settle`). While it waits,
    the worker's progress record says so (``progress.waiting(seq)``, :mod:`elasticzero.progress`).
    """

    __slots__ = ("_aliases", "_progress", "_retire", "_seq", "_work")

    def __init__(
        self,
        work: Any,
        aliases: tuple[torch.Tensor, ...],
        retire: Callable[[tuple[torch.Tensor, ...]], None],
        progress: Reporter,
        seq: int,
    ) -> None:
        self._work = work
        self._aliases = aliases
        self._retire = retire
        self._progress, self._seq = progress, seq

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed it."""
        return self._work is None

    def wait(self) -> None:
        """Block until the collective completed (idempotent)."""
        if self._work is not None:
            self._progress.waiting(self._seq)
            self._work.wait()
            self._progress.waiting(0)
            self._work = None
            self._retire(self._aliases)
            self._aliases = ()


def settles(backend: str, device_type: str) -> bool:
    """Whether collectives of tensors on ``device_type`` need :meth:`Communicator.settle`: when gloo serves them
    (``backend`` is one name, or torch's ``"cpu:gloo,cuda:nccl"`` per-device form). gloo's worker threads let go of a
    tensor after completing its work; NCCL's work keeps its tensors in C++ only (stashed until the collective's end
    event, for the caching allocator) and its watchdog is joined by ``destroy_process_group``, so nothing is waited
    for on the host there (docs/engine.md, "On CUDA")."""
    per_device = dict(part.split(":", 1) for part in backend.lower().split(",") if ":" in part)
    return per_device.get(device_type, backend.lower()) == "gloo"


#: backends whose groups send and receive host tensors (torch's per-device form names one per device type instead)
_HOST_BACKENDS = ("gloo", "mpi")


def wire_for(backend: str, device: torch.device) -> torch.device:
    """The device the messages of a group of ``backend`` travel on, for an engine object computing on ``device``: the
    host when the group takes host tensors (gloo, MPI, or a per-device ``"cpu:gloo,cuda:nccl"`` group that names a
    backend for ``cpu``), else ``device`` itself (NCCL sends CUDA tensors only). The one rule for every buffer the
    buddy copies and the in-memory reshard send or receive (docs/engine.md, "On CUDA")."""
    per_device = dict(part.split(":", 1) for part in backend.lower().split(",") if ":" in part)
    takes_host = "cpu" in per_device if per_device else backend.lower() in _HOST_BACKENDS
    return torch.device("cpu") if takes_host or device.type == "cpu" else device


def p2p_batched(backend: str, device_type: str) -> bool:
    """Whether :meth:`Communicator.exchange` posts its sends and receives as one ``batch_isend_irecv`` (one NCCL
    group): wherever gloo does not serve the tensors. Two NCCL ranks that each send to and receive from the other,
    posted one by one on the pair's stream, wait for each other once a message exceeds NCCL's buffer; in one group
    they progress together. gloo keeps one ``isend``/``irecv`` per tensor (each work settled, :meth:`settle`)."""
    return not settles(backend, device_type)


def _forget(_aliases: tuple[torch.Tensor, ...]) -> None:
    """The retire of a collective that needs no settling: its aliases are simply dropped."""


class LocalWork:
    """A reduce-scatter or all-gather of a one-rank group: ``output`` is ``input`` (the sum over one rank, the
    concatenation of one chunk), so it is a local copy, done when built — none at all when ``output`` is ``input``'s
    own memory (a bucket reduced in place, a master shard that is its parameters' buffer). The backend never sees it:
    gloo would clone the input first, NCCL would launch a kernel to copy a buffer onto itself."""

    __slots__ = ()

    def __init__(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if not same_memory(output, input):
            output.copy_(input.reshape(output.shape))

    @property
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        """Nothing to wait for."""


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same storage (a copy between them is a no-op)."""
    if not (a.is_contiguous() and b.is_contiguous()):
        return False
    return (a.device, a.dtype, a.data_ptr(), a.numel()) == (b.device, b.dtype, b.data_ptr(), b.numel())


Waiter = Callable[[Callable[[], None]], None]
"""How a :class:`Communicator` waits: ``waiter(work.wait)`` blocks until the work completed or raises (a bounded wait
that gives up on a group being reconfigured: ``elasticzero.live.bounded``)."""


class WaitedWork:
    """A work whose :meth:`wait` goes through a :data:`Waiter` (what a communicator built with one returns)."""

    __slots__ = ("_inner", "_waiter")

    def __init__(self, inner: PendingWork | ring.RingWork | LocalWork | WaitedWork, waiter: Waiter) -> None:
        self._inner = inner
        self._waiter = waiter

    @property
    def done(self) -> bool:
        return self._inner.done

    def wait(self) -> None:
        if not self._inner.done:
            self._waiter(self._inner.wait)


AnyWork = PendingWork | ring.RingWork | LocalWork | WaitedWork
"""What an asynchronous collective of a :class:`Communicator` returns (all have ``wait()`` and ``done``)."""


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
            # The one place the engine calls it. The default group is the one torch's default arguments pin (see the
            # import of torch.distributed.nn.functional above), so it is unpinned where the engine starts to use it:
            # when the engine was imported after init_process_group, that import has pinned it by now, and unpinned,
            # destroy_process_group() joins the threads that will carry this communicator's collectives. Subgroups
            # are never pinned.
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
        call of ``all_gather_object`` (its bytes are the pickles', not counted)."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        self.stats.calls[("all_gather_object", tag)] += 1
        return out

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        *,
        tag: str = "replica",
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
        retire = self._settling.extend if gloo else _forget

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
        retire = self._settling.extend if settles(self.backend, tensors[0].device.type) else _forget
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


# modules of torch whose functions bind ``dist.group.WORLD`` as a default argument at import (checked against torch's
# source by tests/unit/engine/test_behaviour_canaries.py); None means "the default group at call time" in all of them
_PINNING_MODULES = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)


def _pinning_functions() -> list[Any]:
    """Functions (and ``__init__`` s) of the already imported pinning modules."""
    found = []
    for name in _PINNING_MODULES:
        module = sys.modules.get(name)
        for obj in vars(module).values() if module is not None else ():
            if isinstance(obj, type) and obj.__module__ == name:
                obj = obj.__dict__.get("__init__")
            if inspect.isfunction(obj) and obj.__module__ == name:
                found.append(obj)
    return found


def default_group_pinned() -> bool:
    """Whether a torch function's default argument holds the live default group (its module imported after init)."""
    world = dist.group.WORLD
    return world is not None and any(
        d is world for f in _pinning_functions() for d in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())
    )


def unpin_default_group() -> int:
    """Replace default arguments that hold the live default group with None (the value they have when their module is
    imported before ``init_process_group``; every such function resolves None to the default group when called), so
    ``destroy_process_group()`` can free the group and join its threads. Returns how many defaults were replaced.

    Called by the engine in one place: :class:`Communicator` opened on the default group (see there)."""
    world, replaced = dist.group.WORLD, 0
    if world is None:
        return 0
    for f in _pinning_functions():
        if any(d is world for d in f.__defaults__ or ()):
            replaced += sum(d is world for d in f.__defaults__)
            f.__defaults__ = tuple(None if d is world else d for d in f.__defaults__)
        if any(d is world for d in (f.__kwdefaults__ or {}).values()):
            replaced += sum(d is world for d in f.__kwdefaults__.values())
            f.__kwdefaults__ = {k: None if d is world else d for k, d in f.__kwdefaults__.items()}
    return replaced
