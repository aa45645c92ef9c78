"""Ring reduce-scatter and all-gather over point-to-point sends, for gloo on CPU.

gloo's own ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are slow on CPU: measured on this project's 2-core
test machine with 25 MiB fp32 buckets and 2 ranks, reduce-scatter 50-56 ms and all-gather 30-35 ms, against 27-28 ms
for an all-reduce (which moves twice the data) and 16 ms for either done here as a ring of ``isend``/``irecv``
(``bench/collectives_bench.py`` reproduces the comparison). The ring is the textbook one: ``N - 1`` steps, each
sending one chunk to the right neighbour and receiving one from the left, so every rank sends and receives
``(N - 1) / N`` of the buffer — the same volume as the native collective.

Both return a :class:`RingWork` with the first step already posted (for two ranks that is the whole exchange, so it
overlaps with compute like any async collective); :meth:`RingWork.wait` finishes it. Every rank of the group must
issue the same ring collectives in the same order (as with any collective). Each ring's messages carry one tag, from
:func:`tag` of the issuing communicator's ring sequence (the caller owns the sequence: this module keeps no state);
gloo matches a receive with the sends from the same peer and tag in posting order, so rings whose tags coincide (two
communicators on one group) stay apart as long as every rank issues and waits for them in the same order.
Inputs are not modified.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticzero.progress import NullReporter, Reporter

_TAG_BASE = 1 << 20


def message_tag(n: int) -> int:
    """The message tag of the ``n``-th ring collective of a sequence (every rank counts the same sequence)."""
    return _TAG_BASE + n % _TAG_BASE


class RingWork:
    """A ring collective in progress; :meth:`wait` completes it (idempotent). ``progress``: the worker's progress
    record and this collective's number, marked as waited in while :meth:`wait` blocks (:mod:`elasticzero.progress`).
    """

    __slots__ = ("_progress", "_retire", "_step", "_steps", "_works")

    def __init__(
        self,
        steps: list[Callable[[], list[Any]]],
        retire: Callable[[tuple[torch.Tensor, ...]], None],
        progress: tuple[Reporter, int] | None = None,
    ):
        self._steps = steps
        self._retire = retire
        self._progress = progress or (NullReporter(), 0)
        self._step = 0
        self._works: list[Any] = self._post()

    def _post(self) -> list[Any]:
        step = self._steps[self._step]
        self._step += 1
        return step()

    @property
    def done(self) -> bool:
        """Whether every step has completed."""
        return not self._works

    def wait(self) -> None:
        """Finish every remaining step."""
        record, seq = self._progress
        if self._works:
            record.waiting(seq)
        while self._works:
            tensors = []
            for work, tensor in self._works:
                work.wait()
                tensors.append(tensor)
            self._works = []
            self._retire(tuple(tensors))
            del tensors
            if self._step < len(self._steps):
                self._works = self._post()
        record.waiting(0)
        self._steps = []  # done: let go of the steps' buffers (the issuer may keep this object a while)


def _exchange(group: Any, tag: int, send: torch.Tensor, right: int, recv: torch.Tensor, left: int) -> list[Any]:
    return [
        (dist.isend(send, dst=right, group=group, tag=tag), send),
        (dist.irecv(recv, src=left, group=group, tag=tag), recv),
    ]


def _neighbours(group: Any) -> tuple[int, int, int, int]:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    right = dist.get_global_rank(group, (r + 1) % n)
    left = dist.get_global_rank(group, (r - 1) % n)
    return n, r, right, left


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    tag: int,
    retire: Callable[[tuple[torch.Tensor, ...]], None],
    progress: tuple[Reporter, int] | None = None,
) -> RingWork:
    """``output`` = this rank's chunk of the sum of every rank's ``input`` (``input`` has ``N * output.numel()``)."""
    n, r, right, left = _neighbours(group)
    c = output.numel()
    chunk = [input[i * c : (i + 1) * c] for i in range(n)]
    # the last step receives straight into ``output`` unless it shares memory with ``input`` (an in-place reduction):
    # with two ranks that is the only step, so nothing is allocated
    direct = output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr()
    recv = torch.empty_like(output) if n > 2 or not direct else output
    acc = [torch.empty_like(output), torch.empty_like(output)] if n > 2 else []
    state: dict[str, torch.Tensor] = {"send": chunk[(r - 1) % n]}

    def step(s: int) -> list[Any]:
        if s > 0:  # the chunk received in the previous step, plus this rank's contribution
            target = acc[s % 2]
            torch.add(chunk[(r - s - 1) % n], recv, out=target)
            state["send"] = target
        into = output if direct and s == n - 2 else recv
        return _exchange(group, tag, state["send"][:], right, into[:], left)

    def finish() -> list[Any]:
        if direct:
            output.add_(chunk[r])  # the received sum plus this rank's own: the same sum, addition commutes
        else:
            torch.add(chunk[r], recv, out=output)
        return []

    steps: list[Callable[[], list[Any]]] = [functools.partial(step, s) for s in range(n - 1)]
    steps.append(finish)
    return RingWork(steps, retire, progress)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    tag: int,
    retire: Callable[[tuple[torch.Tensor, ...]], None],
    progress: tuple[Reporter, int] | None = None,
) -> RingWork:
    """``output`` = every rank's ``input`` concatenated in group-rank order (``input`` may be a view of ``output``)."""
    n, r, right, left = _neighbours(group)
    c = input.numel()
    chunk = [output[i * c : (i + 1) * c] for i in range(n)]
    if chunk[r].data_ptr() != input.data_ptr():
        chunk[r].copy_(input.reshape(-1))

    def step(s: int) -> list[Any]:
        return _exchange(group, tag, chunk[(r - s) % n][:], right, chunk[(r - s - 1) % n][:], left)

    return RingWork([functools.partial(step, s) for s in range(n - 1)], retire, progress)
