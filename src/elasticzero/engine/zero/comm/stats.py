"""Counters of an engine object's collectives (:class:`CommStats`: calls, elements and bytes per op and tag; see the
package's docstring for what is counted)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


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
