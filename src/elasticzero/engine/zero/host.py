"""ZeRO-Offload, the moving parts: host buffers (page-locked where the plan says), the copies between device and host
on a side stream fenced by events, the per-bucket optimizer steps on a host worker thread. The decisions are
:mod:`~elasticzero.engine.zero.offload`'s; this module only carries them out.

Streams and lifetimes (CUDA). A gradient shard is copied D2H on the copy stream after an event recorded on the
current stream once its reduction completed (the reduction's work was waited: the current stream is ordered after
it); the shard is marked used by the copy stream (``record_stream``) so the caching allocator does not hand its memory
to the next bucket before the copy read it. An updated parameter shard is copied H2D on the copy stream after its
host step; its event is what the next reader (the all-gather of stages 1/2, a stage-3 gather) waits on, on its own
stream. A host buffer is written again only after the copy that read it completed (its event, synchronized on the
host). On a CPU device (``cpu_copies``) every copy is a plain synchronous ``copy_`` and every event is None.

The host step runs on one worker thread (torch's CPU kernels release the GIL, so the autograd thread keeps issuing
the rest of backward meanwhile): each offloaded bucket has its own optimizer object over its master, sharing the
wrapped optimizer's ``state`` and taking its param group's hyper-parameters at each step, so a scheduler that sets
the wrapped optimizer's ``lr`` is followed, and the element-wise update is the one the wrapped optimizer computes.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from elasticzero.engine.zero.offload import BucketHome, OffloadOptions, OffloadPlan, plan_homes

__all__ = [
    "BucketSteps",
    "CopyStream",
    "HostGrads",
    "Offloader",
    "host_empty",
    "offloader_for",
    "state_bytes_per_element",
]


def host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised 1-D host tensor, page-locked when ``pinned``."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pinned)


def host_copy(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """``t`` (any device) copied into a new host tensor, page-locked when ``pinned`` (a synchronous copy)."""
    out = host_empty(t.numel(), t.dtype, pinned)
    out.copy_(t.detach().reshape(-1))
    return out


class CopyStream:
    """The copy stream of one optimizer's device (CUDA), or nothing (CPU: synchronous copies)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if enabled else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after_current: bool = True) -> Any:
        """``dst.copy_(src)``; on the copy stream (non-blocking, ordered after the current stream's work so far when
        ``after_current``) returning its completion event, else synchronous returning None. The device tensor among
        the two is marked used by the copy stream."""
        if self.stream is None:
            dst.copy_(src)
            return None
        current = torch.cuda.current_stream(self.device)
        if after_current:
            ready = torch.cuda.Event()
            ready.record(current)
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(self.stream)
        return done

    def order_current(self, event: Any) -> None:
        """The current stream waits for ``event`` (a copy's) before its next work."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def fence(event: Any) -> None:
    """The host waits for ``event`` (a copy's); None: nothing to wait for."""
    if event is not None:
        event.synchronize()


class HostGrads:
    """The fp32 gradient shards of the offloaded buckets, in host memory (persistent, like stage 2's device shards).

    :meth:`land` starts the copy of a reduced shard; :meth:`settle` waits for it and finishes it on the host (adds
    it to what earlier backwards accumulated, or casts a low-precision reduction up). Until settled a shard's values
    are not there: the optimizer settles every landing before anything reads the gradients."""

    def __init__(self, numels: dict[int, int], homes: Sequence[BucketHome], copier: CopyStream) -> None:
        self.copier = copier
        self.grads = {i: host_empty(n, torch.float32, homes[i].pinned) for i, n in numels.items()}
        self._pinned = {i: homes[i].pinned for i in numels}
        self._staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._pending: dict[int, tuple[Any, torch.Tensor | None, bool]] = {}  # index -> (event, staged, add)
        self._lock = threading.Lock()  # the step worker settles its bucket while the autograd thread lands others

    def land(self, index: int, shard: torch.Tensor, accumulate: bool) -> None:
        """Start copying the reduced ``shard`` of bucket ``index`` to the host: straight into its gradient when it is
        the step's first fp32 one, else into a staging buffer that :meth:`settle` adds (or casts) in."""
        self.settle(index)  # an earlier backward's landing of this bucket (its staging buffer is reused)
        direct = not accumulate and shard.dtype == torch.float32
        target = self.grads[index] if direct else self._stage(index, shard.dtype)
        event = self.copier.copy(target, shard.detach())
        self._pending[index] = (event, None if direct else target, accumulate)

    def _stage(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        key = (index, dtype)
        if key not in self._staging:
            self._staging[key] = host_empty(self.grads[index].numel(), dtype, self._pinned[index])
        return self._staging[key]

    def settle(self, index: int) -> None:
        """Wait for bucket ``index``'s landing and finish it on the host (nothing pending: nothing to do)."""
        with self._lock:
            pending = self._pending.pop(index, None)
            if pending is None:
                return
            event, staged, add = pending
            fence(event)
            if staged is not None and add:
                self.grads[index].add_(staged)
            elif staged is not None:
                self.grads[index].copy_(staged)

    def settle_all(self) -> None:
        for index in list(self._pending):
            self.settle(index)

    def pending(self) -> list[int]:
        return list(self._pending)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.grads.values(), *self._staging.values()]


class BucketSteps:
    """Optimizer steps one bucket at a time: on one host worker thread (:meth:`submit`: an offloaded bucket, followed
    by its push, the H2D copy of the updated shard) or on the caller's (:meth:`step_now`: a bucket on the device)."""

    def __init__(self, optim: torch.optim.Optimizer, masters: Sequence[nn.Parameter]) -> None:
        self.optim = optim
        self._group = {id(p): gi for gi, g in enumerate(optim.param_groups) for p in g["params"]}
        self._single = {i: _single_optimizer(optim, m, self._group[id(m)]) for i, m in enumerate(masters)}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ez-offload-step")
        weakref.finalize(self, self._pool.shutdown, wait=False)  # its thread ends with the optimizer
        self._inflight: dict[int, concurrent.futures.Future[Any]] = {}
        self.stepped: set[int] = set()  # buckets stepped since the last done()

    def submit(self, index: int, before: Callable[[], None], after: Callable[[], Any]) -> None:
        """Step bucket ``index`` on the worker: ``before()`` (settle its gradient), the step, then ``after()`` (start
        its H2D copy)."""
        self.stepped.add(index)
        self._inflight[index] = self._pool.submit(self._step, index, before, after)

    def _step(self, index: int, before: Callable[[], None], after: Callable[[], Any]) -> Any:
        before()
        self.step_now(index)
        return after()

    def step_now(self, index: int) -> None:
        """One optimizer step of bucket ``index`` alone (its master must have its ``.grad``), on this thread."""
        single = self._single[index]
        owner = self.optim.param_groups[self._group[id(single.param_groups[0]["params"][0])]]
        single.param_groups[0].update({k: v for k, v in owner.items() if k != "params"})
        single.state = self.optim.state  # torch's load_state_dict rebinds the wrapped optimizer's state
        single.step()

    def wait(self) -> dict[int, Any]:
        """Wait for every submitted step; what each ``after()`` returned (a copy's event), by bucket. A step that
        raised raises here."""
        done = {i: f.result() for i, f in self._inflight.items()}
        self._inflight.clear()
        return done

    def done(self) -> None:
        """The optimizer step is over: forget which buckets stepped."""
        self.stepped.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _single_optimizer(optim: torch.optim.Optimizer, master: nn.Parameter, group: int) -> torch.optim.Optimizer:
    """An optimizer of ``optim``'s class over ``master`` alone, with group ``group``'s hyper-parameters and
    ``optim``'s state object (the same tensors: a step of either updates them)."""
    options = {k: v for k, v in optim.param_groups[group].items() if k != "params"}
    takes = inspect.signature(type(optim)).parameters
    defaults = {k: v for k, v in optim.defaults.items() if k in takes}  # AdamW's defaults carry a key it does not take
    single = type(optim)([{**options, "params": [master]}], **defaults)
    single.state = optim.state
    return single


class Offloader:
    """One ZeRO optimizer's offload: the plan's homes, the host gradients, the per-bucket steps and the pushes.

    The stage builds it before its masters (:meth:`adopt` moves an offloaded master to the host), binds it once the
    wrapped optimizer exists (:meth:`bind`), hands it each reduced shard (:meth:`reduced`), settles at the end of
    backward (:meth:`end_backward`) and steps through it (:meth:`step`); a reader of a pushed shard orders its stream
    after the push (:meth:`order`)."""

    def __init__(self, plan: OffloadPlan, device: torch.device) -> None:
        self.plan = plan
        self.copier = CopyStream(device, plan.side_stream)
        self.armed = False  # this backward ends the optimizer step and nothing forbids stepping in it
        self._grads: HostGrads | None = None
        self._steps: BucketSteps | None = None
        self._masters: list[nn.Parameter] = []
        self._sources: dict[int, torch.Tensor] = {}  # host shard in the compute dtype, pushed / gathered from
        self._targets: dict[int, torch.Tensor] = {}  # device tensor a bucket's updated shard is pushed into
        self._pushed: dict[int, Any] = {}  # bucket -> its last push's event (None: done, or synchronous)

    def home(self, index: int) -> BucketHome:
        return self.plan.homes[index]

    def adopt(self, index: int, master: nn.Parameter) -> nn.Parameter:
        """``master`` itself (a bucket on the device), or a host copy of it (an offloaded one; pinned per the plan)."""
        home = self.home(index)
        if not home.host:
            return master
        return nn.Parameter(host_copy(master, home.pinned))

    def bind(
        self, optim: torch.optim.Optimizer, masters: Sequence[nn.Parameter], compute: Sequence[torch.dtype]
    ) -> None:
        """The wrapped optimizer exists: host gradients for the offloaded buckets, one step object per bucket, and
        each offloaded bucket's host source in its compute dtype (the master itself when that is fp32)."""
        offloaded = self.plan.offloaded()
        self._masters = list(masters)
        self._grads = HostGrads({i: masters[i].numel() for i in offloaded}, self.plan.homes, self.copier)
        self._steps = BucketSteps(optim, masters)
        for i in offloaded:
            if compute[i] != torch.float32:  # fp32: the master itself is the source
                self._sources[i] = host_copy(masters[i].to(compute[i]), self.home(i).pinned)

    def push_into(self, index: int, target: torch.Tensor) -> None:
        """After each step of offloaded bucket ``index``, copy its updated shard into the device tensor ``target``."""
        self._targets[index] = target

    def source(self, index: int) -> torch.Tensor:
        """The host shard of offloaded bucket ``index`` in its compute dtype (what a push or a gather copies): the
        master itself when that is fp32 (read afresh: a load may have given the master new storage)."""
        source = self._sources.get(index)
        return self._masters[index].detach() if source is None else source

    # -- backward ----------------------------------------------------------------------------------------------------
    def reduced(self, index: int, shard: torch.Tensor) -> None:
        """Land the reduced ``shard`` of offloaded bucket ``index``: its master's ``.grad`` becomes the host gradient
        (added to when the master has one: accumulation), its values there once settled (:meth:`settle`,
        :meth:`end_backward`, the step); when armed, its step follows on the worker as soon as it has landed."""
        grads, master = self._host_grads(), self._masters[index]
        grads.land(index, shard, accumulate=master.grad is not None)
        master.grad = grads.grads[index]  # before the worker may step it
        if self.armed:
            self._submit(index)

    def settle(self, index: int) -> None:
        self._host_grads().settle(index)

    def end_backward(self) -> None:
        """Every landing of this backward finished on the host (the gradients are readable)."""
        if self._grads is not None:
            self._grads.settle_all()

    # -- step --------------------------------------------------------------------------------------------------------
    def step(self) -> None:
        """The optimizer step of every bucket not stepped during backward: the offloaded ones on the worker, each
        pushed as soon as it stepped (the next one steps meanwhile), the others here; returns when all are done."""
        steps = self._bucket_steps()
        for i in self.plan.offloaded():
            if i not in steps.stepped:
                self._submit(i)
        for i, home in enumerate(self.plan.homes):
            if not home.host:
                steps.step_now(i)
        self._pushed.update(steps.wait())
        steps.done()

    def _submit(self, index: int) -> None:
        self._bucket_steps().submit(index, lambda: self._before_step(index), lambda: self._push(index))

    def _before_step(self, index: int) -> None:
        """On the worker, before bucket ``index`` steps: its gradient landed, and its last push has read the host
        shard the step is about to write."""
        self.settle(index)
        fence(self._pushed.pop(index, None))

    def _push(self, index: int, after_current: bool = False) -> Any:
        """After bucket ``index`` stepped (on the worker): refresh its compute-dtype host shard, start its H2D copy.
        Not ordered after the current stream: every kernel that read the target (the bucket's parameters in this
        forward/backward) was queued before the reduction its landing was fenced on. ``after_current``: ordered
        after it anyway (a push outside the step: a load, construction)."""
        source = self.source(index)
        if index in self._sources:
            source.copy_(self._masters[index].detach())
        target = self._targets.get(index)
        return None if target is None else self.copier.copy(target, source, after_current=after_current)

    def push_all(self) -> None:
        """Bring every offloaded bucket's host source and device copy up to date with its master (after a load)."""
        for i in self.plan.offloaded():
            fence(self._pushed.pop(i, None))
            self._pushed[i] = self._push(i, after_current=True)

    def order(self, index: int) -> None:
        """The current stream waits for bucket ``index``'s last push (before it reads the pushed shard)."""
        self.copier.order_current(self._pushed.get(index))

    def wait_pushes(self) -> None:
        """The host waits for every push (before a host source is written outside a step: a load)."""
        for i in list(self._pushed):
            fence(self._pushed.pop(i))

    def host_buffers(self) -> list[torch.Tensor]:
        """The host gradient shards and staging buffers, and the compute-dtype host shards (memory accounting)."""
        grads = self._grads.buffers() if self._grads is not None else []
        return [*grads, *self._sources.values()]

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()

    def _host_grads(self) -> HostGrads:
        if self._grads is None:
            raise RuntimeError("Offloader used before bind()")
        return self._grads

    def _bucket_steps(self) -> BucketSteps:
        if self._steps is None:
            raise RuntimeError("Offloader used before bind()")
        return self._steps


def offloader_for(
    options: OffloadOptions | None,
    device: torch.device,
    shard_numels: Sequence[int],
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: Mapping[str, Any],
) -> Offloader | None:
    """The offload of buckets of ``shard_numels`` elements on ``device`` (None when none leaves it: no options, a CPU
    device): sized by the fp32 master and the optimizer state each bucket holds."""
    if options is None or not options.enabled:
        return None
    per_element = 4 + state_bytes_per_element(optimizer_class, dict(optimizer_kwargs))
    plan = plan_homes(options, str(device), [n * per_element for n in shard_numels])
    return Offloader(plan, device) if plan.any_host else None


@torch.no_grad()
def state_bytes_per_element(optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> int:
    """Bytes of element-wise optimizer state per parameter element that ``optimizer_class(**kwargs)`` keeps (AdamW:
    8), measured on a one-element stand-in after one step at lr 0 (CPU; the default implementation)."""
    stand_in = torch.zeros(1, requires_grad=True)
    stand_in.grad = torch.zeros(1)
    options = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach", "capturable")}
    probe = optimizer_class([stand_in], **{**options, "lr": 0.0})
    probe.step()
    state = probe.state[stand_in].values()
    return sum(v.element_size() for v in state if torch.is_tensor(v) and v.dim() == 1 and v.numel() == 1)
