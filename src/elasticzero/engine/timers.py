"""Per-phase wall-clock timers and throughput, off by default and (nearly) free when off.

::

    timers = PhaseTimers(enabled=True)
    for x, y in loader:
        with timers.phase("forward"):
            loss = loss_fn(model(x), y)
        with timers.phase("backward"):
            loss.backward()
        with timers.phase("step"):
            opt.step()
        timers.count(samples=x.shape[0], tokens=x.numel())
    print(timers.format())        # forward 12.1ms x10 | backward ... | 830.2 samples/s 106265 tokens/s

Phase names are free-form ("reduce", "allgather", ...) and may nest; throughput is measured over the wall-clock span
from the first phase start to the last phase stop (nested phases would otherwise be counted twice). With
``synchronize=True`` each start/stop first waits for CUDA (only when CUDA is available), so GPU work is attributed to
the phase that queued it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

__all__ = ["PhaseStats", "PhaseTimers"]

_OFF: AbstractContextManager[None] = nullcontext()


@dataclass
class PhaseStats:
    """Accumulated wall time of one phase."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    @property
    def mean_s(self) -> float:
        """Mean seconds per occurrence (0.0 before the first)."""
        return self.total_s / self.count if self.count else 0.0


class PhaseTimers:
    """Named phase timers plus sample/token counters (see the module docstring)."""

    def __init__(self, enabled: bool = False, synchronize: bool = False) -> None:
        """``enabled=False`` makes :meth:`phase`, :meth:`start`, :meth:`stop` and :meth:`count` no-ops."""
        self.enabled = enabled
        self.synchronize = synchronize
        #: called by :meth:`count` after each step; a true result asks the loop to stop (see ``elasticzero.autotune``)
        self.on_count: Callable[[PhaseTimers], bool] | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every measurement (running phases included)."""
        self._stats: dict[str, PhaseStats] = {}
        self._open: dict[str, float] = {}
        self._first: float | None = None
        self._last: float | None = None
        self.samples = 0
        self.tokens = 0

    # ---------------------------------------------------------------- measuring
    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context manager timing ``name``; a shared no-op context when disabled."""
        if not self.enabled:
            return _OFF
        return self._timed(name)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def start(self, name: str) -> None:
        """Start ``name`` (for code where a ``with`` block does not fit, e.g. hooks); error if already running."""
        if not self.enabled:
            return
        if name in self._open:
            raise RuntimeError(f"PhaseTimers: phase {name!r} is already running")
        self._sync()
        now = time.perf_counter()
        if self._first is None:
            self._first = now
        self._open[name] = now

    def stop(self, name: str) -> float:
        """Stop ``name`` and return its elapsed seconds (0.0 when disabled); error if it is not running."""
        if not self.enabled:
            return 0.0
        started = self._open.pop(name, None)
        if started is None:
            raise RuntimeError(f"PhaseTimers: phase {name!r} was not started")
        self._sync()
        now = time.perf_counter()
        elapsed = now - started
        stats = self._stats.setdefault(name, PhaseStats())
        stats.count += 1
        stats.total_s += elapsed
        stats.max_s = max(stats.max_s, elapsed)
        self._last = now
        return elapsed

    def count(self, samples: int = 0, tokens: int = 0) -> bool:
        """Add processed samples/tokens for the throughput figures (once per step); True asks the loop to stop."""
        if self.enabled:
            self.samples += samples
            self.tokens += tokens
        return self.on_count is not None and bool(self.on_count(self))

    def _sync(self) -> None:
        if self.synchronize:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

    # ---------------------------------------------------------------- reporting
    @property
    def wall_s(self) -> float:
        """Seconds from the first phase start to the last phase stop (0.0 before any phase finished)."""
        if self._first is None or self._last is None:
            return 0.0
        return self._last - self._first

    def summary(self) -> dict[str, Any]:
        """``{"phases": {name: {count, total_s, mean_s, max_s}}, wall_s, samples, tokens, samples_per_s,
        tokens_per_s}``; phases in first-seen order, rates 0.0 when nothing was measured."""
        wall = self.wall_s
        return {
            "phases": {
                name: {"count": s.count, "total_s": s.total_s, "mean_s": s.mean_s, "max_s": s.max_s}
                for name, s in self._stats.items()
            },
            "wall_s": wall,
            "samples": self.samples,
            "tokens": self.tokens,
            "samples_per_s": self.samples / wall if wall > 0 else 0.0,
            "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
        }

    def format(self) -> str:
        """One line: ``name mean-ms xcount`` per phase, then the throughput when samples/tokens were counted."""
        s = self.summary()
        parts = [f"{name} {p['mean_s'] * 1e3:.1f}ms x{p['count']}" for name, p in s["phases"].items()]
        rates = []
        if s["samples"]:
            rates.append(f"{s['samples_per_s']:.1f} samples/s")
        if s["tokens"]:
            rates.append(f"{s['tokens_per_s']:.0f} tokens/s")
        if rates:
            parts.append(" ".join(rates))
        return " | ".join(parts) if parts else "timers: nothing measured" + ("" if self.enabled else " (disabled)")
