"""The handles an asynchronous collective of a :class:`~elasticzero.engine.zero.comm.communicator.Communicator`
returns (:data:`AnyWork`: all have ``wait()`` and ``done``), and how its waits block (:data:`Waiter`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elasticzero.engine.zero import ring
from elasticzero.progress import Reporter


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


def forget(_aliases: tuple[torch.Tensor, ...]) -> None:
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


def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether 1-D ``b`` starts at the element after 1-D ``a``'s last, in the same storage, both laid out element after
    element (one view can cover the two)."""
    if a.stride() != (1,) or b.stride() != (1,) or a.dtype != b.dtype:
        return False
    same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return same and b.storage_offset() == a.storage_offset() + a.numel()


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
