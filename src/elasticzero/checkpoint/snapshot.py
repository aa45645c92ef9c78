"""Taking a snapshot of training state, separate from where it is stored.

:class:`Stager` copies every tensor of a nested state dict (plain tensors and
:class:`~elasticzero.engine.zero.layout.FlatChunk` s) into staging buffers it keeps between saves (CPU, pinned when the
source is on an accelerator), and deep-copies the other values. Once :meth:`Stager.stage` returns, the training loop
may mutate its tensors (the next ``step()``): the snapshot is unaffected (pytorch#144657's torn checkpoints come from
writing live tensors in the background). A storage tier (the disk tier, a future in-memory peer tier) only ever sees
a :class:`Snapshot`, and reads its tensors only after :meth:`Snapshot.wait_ready`.

CUDA tensors (:func:`staging_for`): copied ``non_blocking`` into pinned host buffers on the *current* stream, the one
the training kernels run on, then one event is recorded per device. Stream order is what makes this safe and cheap:
the copy starts after every kernel already queued (the state is the finished step's) and every kernel queued later
(the next forward mutates buffers such as running statistics, the step mutates parameters and optimizer state in
place) runs after it, so the stream waits exactly as long as the copy and the host not at all. A side stream would
need the training stream to wait on it anyway before the next kernel, plus ``record_stream`` for sources freed
while it reads (a ``state_dict()``'s temporaries); on the current stream the caching allocator's stream order covers
those. The host reads a buffer only after its event completed (:meth:`Snapshot.wait_ready`, in the writer).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from elasticzero.engine.zero.layout import FlatChunk


@dataclass
class Snapshot:
    """Step, the staged state (``{key: nested state dict}``, CPU tensors) and JSON-able facts about it."""

    step: int
    state: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    fences: tuple[Fence, ...] = ()  # one per CUDA device copied from: its staging copies are done when it is

    def wait_ready(self) -> None:
        """Block until every staging copy landed (at once for CPU state): call before reading the tensors."""
        for fence in self.fences:
            fence.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in tensors_of(self.state))


def tensors_of(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def collect(t: torch.Tensor, _path: str) -> torch.Tensor:
        out.append(t)
        return t

    map_tree(tree, collect)
    return out


def map_tree(tree: Any, fn: Any, path: str = "") -> Any:
    """Rebuild ``tree`` (dicts, lists, tuples) with ``fn(tensor, path)`` applied to every tensor (a FlatChunk's too);
    other leaves are returned as they are."""
    if isinstance(tree, FlatChunk):
        return tree.with_tensor(fn(tree.tensor, path))
    if torch.is_tensor(tree):
        return fn(tree, path)
    if isinstance(tree, dict):
        return {k: map_tree(v, fn, f"{path}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(v, fn, f"{path}.{i}") for i, v in enumerate(tree))
    return tree


class Fence(Protocol):
    """What a snapshot waits on: ``torch.cuda.Event`` recorded after the staging copies."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Staging:
    """How a tensor on some device is copied to the host: into pinned memory, and without blocking the host."""

    pinned: bool
    non_blocking: bool


def staging_for(device: torch.device) -> Staging:
    """CUDA tensors go into pinned buffers, copied asynchronously (ordered on the current stream, fenced by an
    event); everything else (CPU, meta, other backends' tensors) by a plain synchronous copy into pageable memory."""
    cuda = device.type == "cuda"
    return Staging(pinned=cuda, non_blocking=cuda)


def fences_after(devices: Iterable[torch.device]) -> tuple[Fence, ...]:
    """An event recorded on each CUDA device's current stream, after the copies queued there (none for the CPU)."""
    fences = []
    for device in sorted({d for d in devices if d.type == "cuda"}, key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        fences.append(event)
    return tuple(fences)


class Stager:
    """Copies state into staging buffers reused across saves (same path, shape and dtype → same buffer).

    The caller must not stage again while a previous snapshot is still being written (the
    :class:`~elasticzero.checkpoint.Checkpointer` waits for it first)."""

    def __init__(self) -> None:
        # path → (buffer, how it was made); remembered, not asked: is_pinned() may create a CUDA context
        self._buffers: dict[str, tuple[torch.Tensor, Staging]] = {}

    @torch.no_grad()
    def stage(self, step: int, state: dict[str, Any], info: dict[str, Any] | None = None) -> Snapshot:
        """Copy ``state`` into the staging buffers (CUDA tensors asynchronously: see the snapshot's ``fences``)."""
        staged = {k: map_tree(copy.deepcopy(v, _shallow_tensors(v)), self._copy, k) for k, v in state.items()}
        sources = {t.device for v in state.values() for t in tensors_of(v)}
        return Snapshot(step, staged, dict(info or {}), fences_after(sources))

    def _copy(self, t: torch.Tensor, path: str) -> torch.Tensor:
        t, how = t.detach(), staging_for(t.device)
        buf, made = self._buffers.get(path, (None, None))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or made != how:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=how.pinned)
            self._buffers[path] = (buf, how)
        buf.copy_(t, non_blocking=how.non_blocking)
        return buf


def _shallow_tensors(tree: Any) -> dict[int, Any]:
    """``deepcopy`` memo that keeps tensors (and chunks) as they are: they are copied into staging buffers instead."""
    memo: dict[int, Any] = {}

    def keep(t: torch.Tensor, _path: str) -> torch.Tensor:
        memo[id(t)] = t
        return t

    map_tree(tree, keep)
    return memo


def fresh_like(tree: Any) -> Any:
    """A load template: every tensor replaced by an uninitialised one of the same shape, dtype and device (so a
    failed load touches nothing live); other leaves deep-copied."""
    memo = _shallow_tensors(tree)
    return map_tree(copy.deepcopy(tree, memo), lambda t, _path: torch.empty_like(t.detach()))
