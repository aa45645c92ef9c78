"""Measurement helpers for the engine benchmark's worker processes: collective counting, held tensors, RSS, step
clocks and device peak memory.

Plain torch + stdlib only: this module also runs inside the optional DeepSpeed venv, which has no elasticzero.
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# How many "paper units" of traffic one element of each collective is: in the ZeRO paper's accounting an
# all-reduce is a reduce-scatter plus an all-gather, i.e. it moves its buffer twice.
PAPER_WEIGHT = {"all_reduce": 2}


def _n(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _n_list(ts: Any) -> int:
    return sum(_n(t) for t in ts or ())


def _n_lists(tss: Any) -> int:
    return sum(_n_list(ts) for ts in tss or ())


# function name -> (op it is counted as, argument name, how to count that argument). The counted buffer is the
# *full* one: the input of a reduce-scatter, the output of an all-gather, the tensor of an all-reduce / broadcast.
_COUNTED: dict[str, tuple[str, str, Callable[[Any], int]]] = {
    "all_reduce": ("all_reduce", "tensor", _n),
    "all_reduce_coalesced": ("all_reduce", "tensors", _n_list),
    "reduce_scatter_tensor": ("reduce_scatter", "input", _n),
    "reduce_scatter_single": ("reduce_scatter", "input", _n),
    "_reduce_scatter_base": ("reduce_scatter", "input", _n),
    "reduce_scatter": ("reduce_scatter", "input_list", _n_list),
    "all_gather_into_tensor": ("all_gather", "output_tensor", _n),
    "all_gather_single": ("all_gather", "output_tensor", _n),
    "_all_gather_base": ("all_gather", "output_tensor", _n),
    "all_gather": ("all_gather", "tensor_list", _n_list),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists", _n_lists),
    "broadcast": ("broadcast", "tensor", _n),
    "reduce": ("reduce", "tensor", _n),
    "all_to_all_single": ("all_to_all", "input", _n),
    "all_to_all": ("all_to_all", "input_tensor_list", _n_list),
    "gather": ("gather", "tensor", _n),
    "scatter": ("scatter", "tensor", _n),
    "send": ("send", "tensor", _n),
    "recv": ("recv", "tensor", _n),
    "isend": ("send", "tensor", _n),
    "irecv": ("recv", "tensor", _n),
    "barrier": ("barrier", "", lambda _: 0),
}
# Object collectives are built on the tensor ones: wrapped (as zero elements) only so their inner calls are not
# counted as step traffic.
for _name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"):
    _COUNTED[_name] = ("object", "", lambda _: 0)


class CollectiveCounter:
    """Counts ``numel`` at every ``torch.distributed`` collective call made in this process while enabled.

    :meth:`install` replaces the functions on both ``torch.distributed`` and ``distributed_c10d`` (so ``dist.X``
    and ``from torch.distributed import X`` done *after* install both see the wrapper); install it before importing
    any engine. Only the outermost call is counted (a collective implemented through another is counted once).
    Disabled, a wrapper costs one Python call.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.elements: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._local = threading.local()
        self._lock = threading.Lock()

    def install(self) -> None:
        """Wrap every collective listed in ``_COUNTED`` that this torch has."""
        for name, (op, arg, count) in _COUNTED.items():
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "_ez_bench_wrapped", False):
                continue
            wrapper = self._wrap(original, op, arg, count)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    def _wrap(self, fn: Callable[..., Any], op: str, arg: str, count: Callable[[Any], int]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if self.enabled and depth == 0:
                n = 0
                if arg:
                    bound = sig.bind_partial(*args, **kwargs)
                    n = count(bound.arguments.get(arg))
                with self._lock:
                    self.calls[op] += 1
                    self.elements[op] += n
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper._ez_bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    def reset(self) -> None:
        """Zero the counters."""
        self.elements.clear()
        self.calls.clear()

    def paper_units(self) -> int:
        """Elements in the ZeRO paper's accounting (an all-reduce counts twice)."""
        return sum(n * PAPER_WEIGHT.get(op, 1) for op, n in self.elements.items())


COUNTER = CollectiveCounter()


def ddp_counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook equal to torch's default ``allreduce_hook``, issued through ``dist.all_reduce`` so it is counted.

    DDP's built-in reducer calls the process group from C++, invisible to Python wrappers; torch documents that
    registering ``allreduce_hook`` leaves DDP's results unchanged.
    """
    group = state if state is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer().div_(world)
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations by identity; ``from __future__ import annotations`` would leave strings.
ddp_counting_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of the storage behind a real (non-wrapper, non-meta) tensor, else ``None``."""
    if t.device.type == "meta" or hasattr(t, "_local_tensor"):
        return None
    try:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (ptr, nbytes) if ptr and nbytes else None


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _state_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v)


def held_tensor_bytes(modules: Iterable[torch.nn.Module], exclude: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of every tensor storage alive in this process, de-duplicated by storage, split into categories.

    Every live tensor is found through the garbage collector (so engine-internal flat buffers, masters and buckets
    are seen); each storage counts once, whole (``untyped_storage().nbytes()``). Categories, first match wins:
    ``params`` (storages of the modules' parameters, DTensor local shards and every optimizer's param_groups),
    ``grads`` (their ``.grad``), ``state`` (tensors in any ``torch.optim.Optimizer.state``), ``other`` (the rest:
    buckets, flat gradient partitions not attached as ``.grad``, caches). Tensors in ``exclude`` (the input batch)
    are left out. Storages held only from C++ (autograd graph, DDP reducer buckets) are invisible here.
    """
    gc.collect()
    objects = gc.get_objects()
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    owners = [p for m in modules for p in m.parameters()]
    owners += [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    params = [_local(p) for p in owners]
    grads = [_local(p.grad) for p in owners if p.grad is not None]
    state = [_local(t) for opt in optimizers for t in _state_tensors(dict(opt.state))]
    seen: dict[tuple[int, int], str] = {}
    skip = {k for k in (_storage_key(t) for t in exclude) if k}
    for category, tensors in (("params", params), ("grads", grads), ("state", state)):
        for t in tensors:
            key = _storage_key(t)
            if key and key not in skip:
                seen.setdefault(key, category)
    for o in objects:
        if isinstance(o, torch.Tensor):
            key = _storage_key(o)
            if key and key not in skip:
                seen.setdefault(key, "other")
    del objects
    out = {"params": 0, "grads": 0, "state": 0, "other": 0}
    for (_, nbytes), category in seen.items():
        out[category] += nbytes
    out["total"] = sum(out.values())
    return out


def proc_status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM`` = peak RSS, ``VmRSS`` = current RSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class StepClock:
    """Seconds between marked points of the training loop on ``device``.

    CPU: ``time.perf_counter`` at each mark. CUDA: a timing event recorded on the current stream at each mark, read
    only in :meth:`intervals` (which synchronises once), so timing adds no synchronisation inside the steps: the GPU
    runs ahead of Python as in training, and each interval is the GPU time between two marks in stream order.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        """Add a point (now, on the host; or where the stream has got to, on the GPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks; the clock starts empty again."""
        marks, self.marks = self.marks, []
        if self.cuda:
            if marks:
                marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(marks)]
        return [b - a for a, b in itertools.pairwise(marks)]


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of the device's allocator (CUDA only; nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since :func:`reset_peak_memory` (None on CPU: see VmHWM instead)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))
