"""Taking a snapshot of training state, separate from where it is stored.

:class:`Stager` copies every tensor of a nested state dict (plain tensors and
:class:`~elasticzero.engine.zero.layout.FlatChunk` s) into staging buffers it keeps between saves (CPU, pinned when the
source is on an accelerator), and deep-copies the other values. Once :meth:`Stager.stage` returns, the training loop
may mutate its tensors (the next ``step()``): the snapshot is unaffected (pytorch#144657's torn checkpoints come from
writing live tensors in the background). A storage tier (the disk tier, a future in-memory peer tier) only ever sees
a :class:`Snapshot`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticzero.engine.zero.layout import FlatChunk


@dataclass
class Snapshot:
    """Step, the staged state (``{key: nested state dict}``, CPU tensors) and JSON-able facts about it."""

    step: int
    state: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)

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


class Stager:
    """Copies state into staging buffers reused across saves (same path, shape and dtype → same buffer).

    The caller must not stage again while a previous snapshot is still being written (the
    :class:`~elasticzero.checkpoint.Checkpointer` waits for it first)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, step: int, state: dict[str, Any], info: dict[str, Any] | None = None) -> Snapshot:
        staged = {k: map_tree(copy.deepcopy(v, _shallow_tensors(v)), self._copy, k) for k, v in state.items()}
        return Snapshot(step, staged, dict(info or {}))

    def _copy(self, t: torch.Tensor, path: str) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        buf.copy_(t)
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
