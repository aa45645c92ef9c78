"""The one place where every ZeRO / bucketer collective is issued, and where it is counted.

Each function is a thin, pure wrapper around one ``torch.distributed`` call that first records the call in a
:class:`CommStats` (the optimizer's own, when given) and in :data:`GLOBAL_COMM_STATS`. Elements are counted as the
``numel`` of the *full* buffer of the collective: the input of a reduce-scatter, the output of an all-gather, the
tensor of an all-reduce or broadcast. So a ZeRO-2 step over Ψ parameters counts Ψ (+ at most ``world_size - 1``
padding elements per bucket) of ``reduce_scatter`` and as many of ``all_gather``.

Every call carries a ``tag`` saying why it was issued: ``"grad"`` (gradient reduction), ``"param"`` (parameter
all-gather), ``"norm"`` (global gradient norm, one scalar), ``"init"`` (one-time broadcast of the initial state),
``"state_dict"`` (:meth:`full_state_dict`). A benchmark counting traffic per step sums the ``grad`` and ``param``
tags between two :meth:`CommStats.snapshot` calls.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.nn.functional binds ``group.WORLD`` into its functions' default arguments when it is imported. It
# is imported by torch._dynamo, i.e. by the first torch.optim optimizer a script builds (or by transformers): after
# init_process_group, that pins the default group, so destroy_process_group() no longer joins gloo's threads, and a
# thread still letting go of the last collective's tensors while the interpreter finalizes aborts the process (see
# settle). Imported here, with the engine, before the script initialises the group, the defaults bind None; when the
# script initialised the group first, unpin_default_group() puts None back (what the defaults would have been).
import torch.distributed.nn.functional  # (see above: imported before the script initialises the group)

from elasticzero.engine.zero import ring
from elasticzero.errors import UsageError


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


# torch >= 2.13 renamed the single-tensor collectives (the old names warn); use whichever exists.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

GLOBAL_COMM_STATS = CommStats()
"""Counts every collective issued by any elasticzero ZeRO optimizer or :class:`GradBucketer` in this process."""


class WeakGroup:
    """A weak reference to a process group (the default group when ``group`` is None), resolved at each use.

    Engine objects keep their group through this, never as a strong reference: a live optimizer must not keep a
    destroyed group — and its gloo worker threads — alive past ``dist.destroy_process_group()``. Kept alive, those
    threads drop their last references to the tensors of the final collectives after the script returns and may
    need the GIL while the interpreter finalizes, which aborts the process ("terminate called without an active
    exception", exit -6). With a weak reference, ``destroy_process_group()`` joins them before it returns.
    """

    __slots__ = ("_owner", "_ref")

    def __init__(self, group: Any, owner: str) -> None:
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise UsageError(f"{owner} needs torch.distributed initialised (init_process_group)")
        self._ref = weakref.ref(pg)
        self._owner = owner
        unpin_default_group()

    def __call__(self) -> Any:
        """The group; a :class:`UsageError` once it was destroyed."""
        pg = self._ref()
        if pg is None:
            raise UsageError(
                f"the process group of this {self._owner} was destroyed (destroy_process_group); "
                f"build a new {self._owner} for the new group"
            )
        return pg


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
    ``destroy_process_group()`` can free the group and join its threads. Returns how many defaults were replaced."""
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


def _record(stats: CommStats | None, op: str, tag: str, tensor: torch.Tensor) -> None:
    GLOBAL_COMM_STATS.record(op, tag, tensor)
    if stats is not None and stats is not GLOBAL_COMM_STATS:
        stats.record(op, tag, tensor)


class PendingWork:
    """An asynchronous collective issued through this module; :meth:`wait` completes it.

    Holds the ``torch.distributed`` work and the aliases of the tensors handed to it. After the wait the work is
    dropped and the aliases go to the settle list (see :func:`settle`).
    """

    __slots__ = ("_aliases", "_work")

    def __init__(self, work: Any, aliases: tuple[torch.Tensor, ...]) -> None:
        self._work = work
        self._aliases = aliases

    def wait(self) -> None:
        """Block until the collective completed (idempotent)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            _SETTLING.extend(self._aliases)
            self._aliases = ()


# Aliases of tensors whose collective completed but whose backend thread may still hold them. Why: a gloo worker
# releases its work a moment *after* completing it; each release of a tensor the Python side also knows needs the
# GIL (torch >= 2.10 refcounts the PyObject from C++, and the work's thread-local state holds Python objects too).
# If the script ends in that moment — an optimizer's step is often the last collective — the worker asks for the GIL
# while the interpreter finalizes, is ended by pthread_exit inside a noexcept destructor, and the process aborts
# ("terminate called without an active exception", exit -6). Collectives get fresh aliases known only to this
# module, so "the backend let go" is observable: the alias's refcount falls to the references held here.
_SETTLING: list[torch.Tensor] = []
_SETTLE_TIMEOUT_S = 10.0


def settle(timeout: float = _SETTLE_TIMEOUT_S) -> None:
    """Return once the backend's threads have let go of every tensor of every collective waited for so far.

    Called by the engine at the end of each phase that issued collectives (a bucketer's end of backward, a ZeRO
    ``step``), so no backend thread is still releasing engine tensors when control returns to the training script —
    which may end right then. Collectives still in flight are not waited for. Normally returns at once; polls
    (releasing the GIL) for at most ``timeout`` seconds, then stops tracking what is left rather than hang.
    """
    deadline = 0.0
    while _SETTLING:
        # references to the alias: the list slot and getrefcount's argument; a backend holder adds one
        if sys.getrefcount(_SETTLING[-1]) <= 2:
            _SETTLING.pop()
            continue
        now = time.monotonic()
        if not deadline:
            deadline = now + timeout
        elif now > deadline:
            warnings.warn(
                f"elasticzero: {len(_SETTLING)} collective tensor(s) still held by the backend after {timeout:.0f} s; "
                "no longer waiting for them",
                RuntimeWarning,
                stacklevel=2,
            )
            _SETTLING.clear()
            return
        time.sleep(1e-4)


# Reduce-scatter and all-gather of CPU tensors over gloo run as point-to-point rings (:mod:`.ring`: 2-3x faster than
# gloo's own); ELASTICZERO_GLOO_RING=0 in the environment uses gloo's collectives instead. Decided once per group, when
# the engine first uses it (so every collective of a group takes the same path), and cached here: group -> "the ring
# applies"; keyed by the group object (weakly): a group name can come back after a re-init.
_gloo_groups: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _ring_applies(pg: Any) -> bool:
    enabled = os.environ.get("ELASTICZERO_GLOO_RING", "1") != "0"
    return enabled and "gloo" in str(dist.get_backend(pg)).lower() and dist.get_world_size(pg) > 1


def _use_ring(tensor: torch.Tensor, group: Any) -> Any:
    """The resolved group when the ring applies to ``tensor`` on ``group``, else None."""
    if tensor.device.type != "cpu":
        return None
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    ok = _gloo_groups.get(pg)
    if ok is None:
        ok = _gloo_groups[pg] = _ring_applies(pg)
    return pg if ok else None


def _finish(work: Any, async_op: bool) -> Any:
    """The work itself when asynchronous; otherwise wait for it, settle, and return None."""
    if async_op:
        return work
    work.wait()
    settle()
    return None


def _issue(fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], async_op: bool, **kwargs: Any) -> Any:
    aliases = tuple(t.detach() for t in tensors)
    pending = PendingWork(fn(*aliases, async_op=True, **kwargs), aliases)
    del aliases  # from here on only the pending work (then the settle list) refers to them
    return _finish(pending, async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    *,
    stats: CommStats | None = None,
    tag: str = "grad",
    async_op: bool = False,
) -> PendingWork | ring.RingWork | None:
    """Sum ``input`` (``world_size * output.numel()`` elements) over ranks; this rank's chunk lands in ``output``."""
    _record(stats, "reduce_scatter", tag, input)
    pg = _use_ring(input, group)
    if pg is not None:
        return _finish(ring.reduce_scatter(output, input, pg, _SETTLING.extend), async_op)
    return _issue(_reduce_scatter, (output, input), async_op, op=dist.ReduceOp.SUM, group=group)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    *,
    stats: CommStats | None = None,
    tag: str = "param",
    async_op: bool = False,
) -> PendingWork | ring.RingWork | None:
    """Concatenate every rank's ``input`` into ``output`` (``input`` may be this rank's chunk of ``output``)."""
    _record(stats, "all_gather", tag, output)
    pg = _use_ring(output, group)
    if pg is not None:
        return _finish(ring.all_gather(output, input, pg, _SETTLING.extend), async_op)
    return _issue(_all_gather, (output, input), async_op, group=group)


def all_reduce(
    tensor: torch.Tensor,
    group: Any,
    *,
    op: Any = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    tag: str = "grad",
    async_op: bool = False,
) -> PendingWork | ring.RingWork | None:
    """Reduce ``tensor`` in place over ranks with ``op`` (SUM by default)."""
    _record(stats, "all_reduce", tag, tensor)
    return _issue(dist.all_reduce, (tensor,), async_op, op=op, group=group)


def broadcast(
    tensor: torch.Tensor, src_group_rank: int, group: Any, *, stats: CommStats | None = None, tag: str = "init"
) -> None:
    """Copy ``tensor`` from group rank ``src_group_rank`` to every rank (tag ``"init"``)."""
    _record(stats, "broadcast", tag, tensor)
    _issue(dist.broadcast, (tensor,), False, group=group, group_src=src_group_rank)
