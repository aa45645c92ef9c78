"""A warm-up/measure window on :class:`~elasticzero.engine.timers.PhaseTimers` that reports and ends a trial.

::

    timers = PhaseTimers(enabled=True)
    autotune.measure(timers)                 # a no-op unless the tuner started this process
    for x, y in loader:
        ...
        if timers.count(samples=x.shape[0]):  # True once the window is measured and reported
            break

The tuner sets the window per experiment (``ELASTICZERO_AUTOTUNE_WARMUP_STEPS``, ``…_MEASURE_STEPS``; successive
halving gives later rounds more steps). After the warm-up the timers are reset; after the measured steps rank 0
reports ``throughput`` (samples/s over all ranks: each rank counts its own samples), ``latency`` (s/step), their
spreads (``*_stdev``, per step), ``steps``, ``memory`` (peak bytes: CUDA allocator when CUDA is in use, else the
process's peak RSS) and, given ``flops_per_sample``, ``flops``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elasticzero.autotune.contract import METRICS_ENV, report

if TYPE_CHECKING:
    from elasticzero.engine.timers import PhaseTimers

__all__ = ["MEASURE_ENV", "WARMUP_ENV", "MeasureWindow", "measure", "memory_source", "window_steps"]

WARMUP_ENV = "ELASTICZERO_AUTOTUNE_WARMUP_STEPS"
MEASURE_ENV = "ELASTICZERO_AUTOTUNE_MEASURE_STEPS"
DEFAULT_WARMUP = 3
DEFAULT_MEASURE = 10


def window_steps(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(warm-up steps, measured steps)`` the tuner asked for (defaults 3 and 10)."""
    env = os.environ if env is None else env
    warm = env.get(WARMUP_ENV, "")
    meas = env.get(MEASURE_ENV, "")
    return (
        int(warm) if warm.isdigit() else DEFAULT_WARMUP,
        max(1, int(meas)) if meas.isdigit() else DEFAULT_MEASURE,
    )


@dataclass
class MeasureWindow:
    """The ``on_count`` hook: skip ``warmup`` steps, time ``steps`` steps, report, ask the loop to stop."""

    warmup: int
    steps: int
    world_size: int = 1
    flops_per_sample: float | None = None
    done: bool = False
    _seen: int = 0
    _marks: list[tuple[float, int]] = field(default_factory=list)  # (time, samples so far) at each measured step

    def __call__(self, timers: PhaseTimers) -> bool:
        if self.done:
            return True
        self._seen += 1
        if self._seen <= self.warmup:
            if self._seen == self.warmup:
                timers.reset()
                self._marks = [(time.perf_counter(), 0)]
            return False
        if not self._marks:  # no warm-up: the first step's start is the first phase start
            self._marks = [(time.perf_counter() - timers.wall_s, 0)]
        self._marks.append((time.perf_counter(), timers.samples))
        if len(self._marks) - 1 < self.steps:
            return False
        report("ok", self.metrics())
        self.done = True
        return True

    def metrics(self) -> dict[str, float]:
        """The figures of the measured steps."""
        durations = [b[0] - a[0] for a, b in zip(self._marks, self._marks[1:], strict=False)]
        samples = [b[1] - a[1] for a, b in zip(self._marks, self._marks[1:], strict=False)]
        total = sum(durations)
        rates = [s * self.world_size / d for s, d in zip(samples, durations, strict=True) if d > 0]
        out = {
            "steps": float(len(durations)),
            "latency": total / len(durations),
            "latency_stdev": statistics.stdev(durations) if len(durations) > 1 else 0.0,
            "throughput": sum(samples) * self.world_size / total if total > 0 else 0.0,
            "throughput_stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            "memory": float(_peak_memory()),
        }
        if self.flops_per_sample:
            out["flops"] = out["throughput"] * self.flops_per_sample
        return out


def memory_source(cuda_available: bool, cuda_initialized: bool) -> str:
    """Whose peak the ``memory`` metric is: ``"cuda"`` (the caching allocator's peak on the current device,
    ``torch.cuda.max_memory_allocated``: what runs out on a GPU) once this process has used CUDA, else ``"rss"`` (the
    process's peak resident set: what runs out on the CPU)."""
    return "cuda" if cuda_available and cuda_initialized else "rss"


def _peak_memory() -> int:
    import sys

    torch = sys.modules.get("torch")  # not imported: this process cannot have used CUDA
    if torch is not None and memory_source(torch.cuda.is_available(), torch.cuda.is_initialized()) == "cuda":
        return int(torch.cuda.max_memory_allocated())  # the current device: the worker's (init_distributed set it)
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def measure(
    timers: PhaseTimers,
    *,
    warmup_steps: int | None = None,
    measure_steps: int | None = None,
    flops_per_sample: float | None = None,
) -> MeasureWindow | None:
    """Install a :class:`MeasureWindow` on ``timers`` (and enable them) when running under the tuner.

    Outside a tuning run (``$ELASTICZERO_AUTOTUNE_METRICS`` unset) nothing changes and ``None`` is returned.
    The window's sizes default to what the tuner asked for (:func:`window_steps`).
    """
    if not os.environ.get(METRICS_ENV):
        return None
    warm, meas = window_steps()
    world = os.environ.get("WORLD_SIZE", "1")
    window = MeasureWindow(
        warmup=warm if warmup_steps is None else warmup_steps,
        steps=meas if measure_steps is None else measure_steps,
        world_size=int(world) if world.isdigit() else 1,
        flops_per_sample=flops_per_sample,
    )
    timers.enabled = True
    timers.on_count = window
    return window
