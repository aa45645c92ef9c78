"""Tuning metrics: which figure a trial is judged by, in which direction, and a noise-aware comparison.

Throughput and FLOPS are maximised, latency and memory minimised (DeepSpeed's autotuner maximised ``latency``).
A trial reports ``{"metrics": {"throughput": …, "throughput_stdev": …, "steps": …}}``; the ``<name>_stdev`` and
``steps`` entries, when present, make comparisons noise-aware: two means closer than ``z`` standard errors of their
difference (plus a relative floor) are a tie, never a win.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from elasticzero.errors import UsageError

__all__ = ["METRICS", "Measurement", "Metric", "get_metric"]


@dataclass(frozen=True)
class Metric:
    """A metric name and whether larger is better."""

    name: str
    maximize: bool
    unit: str

    def better(self, a: float, b: float) -> bool:
        """Whether value ``a`` is strictly better than ``b`` (no noise model)."""
        return a > b if self.maximize else a < b

    def sort_key(self, value: float) -> float:
        """A key that sorts best first."""
        return -value if self.maximize else value


METRICS: dict[str, Metric] = {
    "throughput": Metric("throughput", True, "samples/s"),
    "flops": Metric("flops", True, "FLOP/s"),
    "latency": Metric("latency", False, "s/step"),
    "memory": Metric("memory", False, "bytes"),
}


def get_metric(name: str, where: str = "autotuning.metric") -> Metric:
    """The metric called ``name``; an unknown name is a :class:`UsageError` listing the known ones."""
    metric = METRICS.get(str(name).lower())
    if metric is None:
        raise UsageError(f"{where}: unknown metric {name!r}; use one of {', '.join(METRICS)}")
    return metric


@dataclass(frozen=True)
class Measurement:
    """A trial's value of one metric with its standard error (0.0 when the trial gave no spread)."""

    value: float
    stderr: float = 0.0

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, object], name: str) -> Measurement | None:
        """The measurement of ``name`` in a trial's ``metrics`` mapping, or ``None`` when it is absent."""
        value = metrics.get(name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            return None
        stdev = metrics.get(f"{name}_stdev")
        steps = metrics.get("steps")
        if isinstance(stdev, int | float) and isinstance(steps, int | float) and steps >= 1 and math.isfinite(stdev):
            return cls(float(value), abs(float(stdev)) / math.sqrt(float(steps)))
        return cls(float(value))


def clearly_better(metric: Metric, a: Measurement, b: Measurement, z: float = 2.0, rel_floor: float = 0.01) -> bool:
    """Whether ``a`` beats ``b`` by more than the noise: ``z`` standard errors and ``rel_floor`` of ``b``."""
    margin = max(z * math.hypot(a.stderr, b.stderr), rel_floor * abs(b.value))
    delta = a.value - b.value if metric.maximize else b.value - a.value
    return delta > margin
