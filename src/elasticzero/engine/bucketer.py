"""GradBucketer: gradient buckets reduced during backward, in the same order on every rank.

Usable on its own for DDP-style data parallelism::

    bucketer = GradBucketer(model.named_parameters(), op="all_reduce", bucket_bytes=25 * 2**20)
    loss.backward()          # buckets are all-reduced (averaged) as they fill; after backward p.grad is the mean
    opt.step()               # any plain torch optimizer

and used by ZeRO stages 2/3 with ``op="reduce_scatter"`` (each rank receives only its shard of every bucket).

How it works: a post-accumulate-grad hook on every parameter adds ``grad / contributors`` (the world size, unless
some ranks sit a step out: :meth:`GradBucketer.contributing`) into its bucket's flat buffer (in ``reduce_dtype``,
fp32 by default) and drops ``param.grad``. Buckets are keyed by dtype, bounded by ``bucket_bytes``, and a tensor of
``bucket_bytes`` or more is a bucket of its own (see :func:`elasticzero.engine.zero.flat.build_buckets`). A bucket is
*launched* (async collective) once all its parameters have their gradient **and every bucket before it in the fixed
flush order has been launched**. The flush order is reverse bucket order (buckets are numbered by parameter
registration, backward roughly visits them last to first); it never depends on the order hooks fire in, which may
differ between ranks and is the classic cause of ZeRO hangs.
At the end of backward (an autograd engine callback) every remaining bucket is launched in order, parameters that got
no gradient contributing zeros, and all outstanding collectives are waited for. At most ``max_inflight`` collectives
are outstanding; the oldest is completed before the next is launched, which bounds the transient buffer memory.

A rank that computes nothing in a step still takes part in its reductions, with zeros: :meth:`GradBucketer.finalize`
without a backward launches every bucket, in the flush order the others launch theirs in.

Repeated ``backward()`` calls accumulate. Inside :meth:`no_sync` nothing is communicated: gradients accumulate in the
full-size bucket buffers (Ψ elements of ``reduce_dtype`` held until the boundary) and are reduced by the first
backward outside the context.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from elasticzero.engine.zero.comm.communicator import Communicator, OwnsCommunicator
from elasticzero.engine.zero.comm.stats import CommStats
from elasticzero.engine.zero.flat import FlatBucket, _device_of, build_buckets
from elasticzero.errors import UsageError

Op = Literal["all_reduce", "reduce_scatter"]
DEFAULT_BUCKET_BYTES = 25 * 2**20


def phase(timers: Any, name: str) -> contextlib.AbstractContextManager[Any]:
    """``timers.phase(name)`` or a no-op context when ``timers`` is None."""
    return contextlib.nullcontext() if timers is None else timers.phase(name)


class GradBucketer(OwnsCommunicator):
    """Bucketed, ordered gradient reduction driven by autograd hooks.

    Args:
        params: parameters or ``(name, parameter)`` pairs in registration order; frozen ones are skipped.
        op: ``"all_reduce"`` (DDP-style: after backward ``p.grad`` holds the mean over ranks, in ``p.dtype``) or
            ``"reduce_scatter"`` (``on_reduced(bucket, shard)`` receives this rank's summed-mean shard).
        bucket_bytes: upper bound of one bucket, counted in ``reduce_dtype``.
        process_group: the data-parallel group (default: the default group).
        reduce_dtype: dtype gradients are accumulated and reduced in (default fp32).
        buckets: explicit bucket layouts (ZeRO stages pass theirs); overrides ``params``/``bucket_bytes``.
        on_reduced: called once per bucket per reduction with the reduced tensor (whole bucket or this rank's shard).
        on_ready: called when all of a bucket's parameters have their gradient (ZeRO-3 frees the parameters there).
        on_finalize: called at the end of every backward after all reductions completed.
        shard_out: where a reduce-scatter writes this rank's shard of a bucket (``shard_numel`` elements of
            ``reduce_dtype``, e.g. a gradient shard kept between steps), or None for a new tensor. In a one-rank group
            the bucket buffer is its own shard and is reduced in place (nothing to allocate, copy or send).
        keep_buffers: keep the bucket buffers allocated between steps (ZeRO-1); otherwise a bucket's buffer is
            let go of once reduced: a reduce-scatter's input launched during backward joins at most ``max_inflight +
            1`` spares that later buckets, of this backward and the next, are filled in (:meth:`spare_buffers`);
            anything else is freed.
        max_inflight: at most this many collectives outstanding.
        launch_in_backward: launch a bucket as soon as it (and every bucket before it in flush order) is complete.
            False: launch every bucket at the end of backward. When the same process group also carries
            collectives issued at rank-independent points of backward (ZeRO-3's parameter all-gathers), completion
            is not rank-independent (a parameter unused on one rank completes only there at the end), so launching
            early would interleave the collectives differently on different ranks and hang.
        comm_stats: the :class:`~elasticzero.engine.zero.comm.CommStats` to count into (default: new ones;
            ``bucketer.comm_stats`` either way).
        timers: optional ``PhaseTimers``; reductions are timed under ``"reduce"``.
        communicator: a :class:`~elasticzero.engine.zero.comm.Communicator` to share (a ZeRO optimizer passes its
            own), instead of opening one on ``process_group`` counting into ``comm_stats``.

    Attributes:
        communicator: issues, counts and settles the reductions; assigning one on another group of the same ranks
            replaces it (the old one is closed).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]] = (),
        *,
        op: Op = "all_reduce",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        process_group: Any = None,
        reduce_dtype: torch.dtype = torch.float32,
        buckets: Sequence[FlatBucket] | None = None,
        on_reduced: Callable[[FlatBucket, torch.Tensor], None] | None = None,
        on_ready: Callable[[FlatBucket], None] | None = None,
        on_finalize: Callable[[], None] | None = None,
        shard_out: Callable[[FlatBucket], torch.Tensor | None] | None = None,
        keep_buffers: bool = False,
        max_inflight: int = 2,
        comm_stats: CommStats | None = None,
        timers: Any = None,
        launch_in_backward: bool = True,
        communicator: Communicator | None = None,
    ) -> None:
        if op not in ("all_reduce", "reduce_scatter"):
            raise UsageError(f"GradBucketer op must be 'all_reduce' or 'reduce_scatter', not {op!r}")
        if communicator is not None and (process_group is not None or comm_stats is not None):
            raise UsageError("GradBucketer: communicator= brings its group and stats; drop process_group/comm_stats")
        self.op: Op = op
        if communicator is None:
            communicator = Communicator(process_group, owner="GradBucketer", stats=comm_stats)
        self._communicator = communicator
        self.world_size = self._communicator.size
        self.rank = self._communicator.rank
        #: the ranks whose gradients a reduction averages (:meth:`contributing`); the others add zeros
        self.contributors = self.world_size
        self.reduce_dtype = reduce_dtype
        if buckets is None:
            pairs: list[tuple[str, nn.Parameter]] = [
                (f"param{i}", p) if isinstance(p, torch.Tensor) else p  # type: ignore[misc]
                for i, p in enumerate(params)
            ]
            named = [(n, p) for n, p in pairs if p.requires_grad]
            buckets = build_buckets(
                named,
                bucket_bytes=bucket_bytes,
                world_size=self.world_size,
                rank=self.rank,
                elem_size=lambda p: torch.empty((), dtype=reduce_dtype).element_size(),
            )
        self.buckets: list[FlatBucket] = list(buckets)
        self._devices: dict[int, torch.device] = {b.index: _device_of(b.params) for b in self.buckets}
        self.flush_order: list[int] = [b.index for b in reversed(self.buckets)]
        self.on_reduced = on_reduced if on_reduced is not None else self._write_mean_grads
        self.on_ready = on_ready
        self.on_finalize = on_finalize
        self.shard_out = shard_out
        self.keep_buffers = keep_buffers
        self.max_inflight = max(1, max_inflight)
        self.launch_in_backward = launch_in_backward
        self.timers = timers
        self._slot: dict[nn.Parameter, tuple[FlatBucket, int]] = {}  # param -> (bucket, position in it)
        for b in self.buckets:
            for pos, p in enumerate(b.params):
                self._slot[p] = (b, pos)
        self._buffers: dict[int, torch.Tensor] = {}
        self._unwritten: dict[int, set[int]] = {}  # slots not yet written since allocated or zero_buffers()
        self._spares: list[torch.Tensor] = []  # reduced transient buffers, filled again by later buckets
        self._bases: dict[int, torch.Tensor] = {}  # a transient buffer's whole allocation (it may view a spare)
        self._arrived: dict[int, set[int]] = {b.index: set() for b in self.buckets}
        self._ready: set[int] = set()
        self._next = 0  # position in flush_order of the next bucket to launch
        self._inflight: deque[tuple[FlatBucket, torch.Tensor, Any]] = deque()
        self._callback_queued = False
        self._sync = True
        self._launched: list[int] = []
        self.last_launch_order: list[int] = []
        """Bucket indices in the order the last reduction launched them (always ``flush_order``)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._slot]
        if keep_buffers:
            self.allocate_buffers()

    # -- public ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (full-size buffers) without communicating; reduce at the next backward."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @contextlib.contextmanager
    def contributing(self, ranks: int) -> Iterator[None]:
        """Average the gradients accumulated inside over ``ranks`` ranks instead of the world size: a step in which
        the other ranks sit out (their reductions add zeros), whose mean is over the ranks that computed it."""
        if not 1 <= ranks <= self.world_size:
            raise UsageError(f"contributing({ranks}): between 1 and the group's {self.world_size} ranks")
        old, self.contributors = self.contributors, ranks
        try:
            yield
        finally:
            self.contributors = old

    def allocate_buffers(self) -> None:
        """Allocate (zeroed) every bucket buffer now."""
        for b in self.buckets:
            self.buffer(b)

    def buffer(self, bucket: FlatBucket) -> torch.Tensor:
        """The bucket's flat gradient buffer (allocated zeroed on first use, on its parameters' device)."""
        buf = self._buffers.get(bucket.index)
        if buf is None:
            buf = torch.zeros(bucket.padded_numel, dtype=self.reduce_dtype, device=self._devices[bucket.index])
            self._buffers[bucket.index] = buf
        self._zero_unwritten(bucket, buf)
        return buf

    def _accumulate(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        """Add ``grad / contributors`` into the bucket slot of parameter ``pos``.

        A transient buffer (``keep_buffers=False``) is allocated uninitialised and each slot's first gradient is
        written, not added: no zero-fill pass and no read of the buffer; slots left unwritten are zeroed before
        the buffer is reduced or handed out (:meth:`buffer`).
        """
        idx, off, n = bucket.index, bucket.offsets[pos], bucket.params[pos].numel()
        buf = self._buffers.get(idx)
        if buf is None and not self.keep_buffers:
            buf = self._transient(bucket)
            buf[bucket.numel :].zero_()
            self._buffers[idx] = buf
            self._unwritten[idx] = set(range(len(bucket.params)))
        elif buf is None:
            buf = self.buffer(bucket)
        unwritten = self._unwritten.get(idx)
        with torch.no_grad():
            if unwritten is not None and pos in unwritten:
                unwritten.discard(pos)
                torch.mul(grad.reshape(-1), 1.0 / self.contributors, out=buf[off : off + n])
            else:
                buf[off : off + n].add_(grad.reshape(-1), alpha=1.0 / self.contributors)

    def _transient(self, bucket: FlatBucket) -> torch.Tensor:
        """An uninitialised buffer for ``bucket``: the smallest spare large enough (on its device), else a new one."""
        device, n = self._devices[bucket.index], bucket.padded_numel
        fits = [(s.numel(), i) for i, s in enumerate(self._spares) if s.device == device and s.numel() >= n]
        base = self._spares.pop(min(fits)[1]) if fits else torch.empty(n, dtype=self.reduce_dtype, device=device)
        self._bases[bucket.index] = base
        return base[:n]

    def _zero_unwritten(self, bucket: FlatBucket, buf: torch.Tensor) -> None:
        unwritten = self._unwritten.pop(bucket.index, None)
        for pos in unwritten or ():
            off = bucket.offsets[pos]
            buf[off : off + bucket.params[pos].numel()].zero_()

    def held_buffers(self) -> list[torch.Tensor]:
        """The bucket buffers currently allocated (for memory accounting); spares not included."""
        return list(self._buffers.values())

    def spare_buffers(self) -> list[torch.Tensor]:
        """Reduced bucket buffers kept for later buckets to be filled in (at most ``max_inflight + 1``).

        Why kept across backwards: a buffer freed at the end of one backward and allocated again in the next is fresh
        memory to the CPU allocator (glibc serves buffers this large with ``mmap`` and unmaps them on free), so every
        4 KiB of it page-faults back in, every step: on the engine bench's 30M GPT, 2 ranks, about 30k faults and
        the largest share of ZeroStage2's excess over DDP. On CUDA the caching allocator keeps such blocks anyway."""
        return list(self._spares)

    def zero_buffers(self) -> None:
        """Zero (``keep_buffers``) or drop every buffer, discarding gradients accumulated under :meth:`no_sync`.

        A kept buffer is zeroed lazily: its slots are marked unwritten, so the next backward writes each gradient
        instead of adding it to zeros (no zero-fill pass, no read of the buffer); :meth:`buffer` zeroes what is still
        unwritten before anyone reads it."""
        if self.keep_buffers:
            for b in self.buckets:
                if b.index in self._buffers:
                    self._unwritten[b.index] = set(range(len(b.params)))
        else:
            self._buffers.clear()
            self._bases.clear()
            self._unwritten.clear()
        for s in self._arrived.values():
            s.clear()

    def forget(self, bucket: FlatBucket) -> None:
        """Mark a kept buffer's slots unwritten (zeroed lazily, as :meth:`zero_buffers` does): its contents were
        taken elsewhere (ZeRO-Offload landed the reduced shard in host memory) and must not be added to again."""
        if self.keep_buffers and bucket.index in self._buffers:
            self._unwritten[bucket.index] = set(range(len(bucket.params)))

    def finalize(self) -> None:
        """Launch every bucket not yet launched (in flush order) and complete all reductions.

        Runs automatically at the end of every backward that touched a bucketed parameter; call it yourself when
        gradients were produced without autograd hooks, or when this rank computed nothing: its reductions then add
        zeros.
        """
        self._callback_queued = False
        if self._sync:
            self._reduce_the_rest()
            self._ready.clear()
            self._next = 0
            self.last_launch_order, self._launched = self._launched, []
        for s in self._arrived.values():
            s.clear()
        if self.on_finalize is not None:
            self.on_finalize()

    def _reduce_the_rest(self) -> None:
        with phase(self.timers, "reduce"):
            for b in self.buckets:
                if b.index not in self._ready:
                    self._add_leftover_grads(b)
                    self._mark_ready(b)
            self._ready.update(b.index for b in self.buckets)
            self._launch_ready()
            while self._inflight:
                self._complete_oldest()
            self._communicator.settle()

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- internals ---------------------------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        bucket, pos = self._slot[p]  # type: ignore[index]
        grad = p.grad
        if grad is None:
            return
        self._accumulate(bucket, pos, grad)
        p.grad = None
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        arrived = self._arrived[bucket.index]
        arrived.add(id(p))
        if self._sync and len(arrived) == len(bucket.params):
            self._mark_ready(bucket)
            self._ready.add(bucket.index)
            if self.launch_in_backward:
                self._launch_ready()

    def _add_leftover_grads(self, bucket: FlatBucket) -> None:
        """Parameters that got no gradient in this backward contribute what ``p.grad`` holds (zeros if None)."""
        arrived = self._arrived[bucket.index]
        for pos, p in enumerate(bucket.params):
            if id(p) not in arrived and p.grad is not None:
                self._accumulate(bucket, pos, p.grad)
                p.grad = None

    def _mark_ready(self, bucket: FlatBucket) -> None:
        if self.on_ready is not None:
            self.on_ready(bucket)

    def _launch_ready(self) -> None:
        while self._next < len(self.flush_order) and self.flush_order[self._next] in self._ready:
            bucket = self.buckets[self.flush_order[self._next]]
            self._next += 1
            while len(self._inflight) >= self.max_inflight:
                self._complete_oldest()
            self._launch(bucket)

    def _launch(self, bucket: FlatBucket) -> None:
        self._launched.append(bucket.index)
        buf = self.buffer(bucket)
        if self.op == "all_reduce":
            work = self._communicator.all_reduce(buf, async_op=True)
            out = buf
        else:
            out = self._shard_destination(bucket, buf)
            work = self._communicator.reduce_scatter(out, buf, async_op=True)
        self._inflight.append((bucket, out, work))

    def _shard_destination(self, bucket: FlatBucket, buf: torch.Tensor) -> torch.Tensor:
        """Where this rank's shard of ``bucket`` is reduced to: the buffer itself in a one-rank group, else
        ``shard_out``'s tensor or a new one."""
        if self.world_size == 1:
            return buf
        given = self.shard_out(bucket) if self.shard_out is not None else None
        return given if given is not None else torch.empty(bucket.shard_numel, dtype=buf.dtype, device=buf.device)

    def _complete_oldest(self) -> None:
        bucket, out, work = self._inflight.popleft()
        work.wait()
        self.on_reduced(bucket, out)
        if not self.keep_buffers:
            buf = self._buffers.pop(bucket.index, None)
            base = self._bases.pop(bucket.index, None)
            self._unwritten.pop(bucket.index, None)
            if base is not None and self._reusable(buf, out):
                self._spares.append(base)
                self._spares.sort(key=lambda t: t.numel())
                del self._spares[: -(self.max_inflight + 1)]  # the largest kept: they fit any bucket

    def _reusable(self, buf: torch.Tensor | None, out: torch.Tensor) -> bool:
        """Whether a reduced transient buffer may serve a later bucket: a reduce-scatter's input (handed to nobody;
        an all-reduce's result went to ``on_reduced``, as does a one-rank bucket, its own shard) of a bucketer that
        launches during backward. One that launches everything at the end of backward (ZeRO-3) holds every bucket
        then and frees them as they complete, so the memory held falls again; it keeps none."""
        handed = self.op != "reduce_scatter" or buf is out
        return not handed and self.launch_in_backward

    def _write_mean_grads(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        if self.op != "all_reduce":
            raise UsageError("GradBucketer(op='reduce_scatter') needs an on_reduced callback to receive the shards")
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            p.grad = reduced[off : off + p.numel()].view(p.shape).to(p.dtype, copy=True)
