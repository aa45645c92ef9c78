"""How an experiment ended, decided from its exit status and its report file (pure; output is never read).

=====================================  ==========================================================
exit status / report                   outcome
=====================================  ==========================================================
timed out, report ``ok``               ``ok`` (it measured, then hung: killed, figures kept)
timed out otherwise                    ``timeout``
report ``oom`` (any exit status)       ``oom``
report ``error``                       ``error`` with the trial's message
report ``ok``, exit 0                  ``ok`` — unless the tuned metric is missing (``error``)
report ``ok``, exit ≠ 0                ``error`` (it failed after reporting)
no report, exit 0                      ``error``: "exited 0 without writing its report"
no report, exit N                      ``error``: "exit code N without a report"
=====================================  ==========================================================
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from elasticzero.autotune.contract import METRICS_ENV, TrialReport
from elasticzero.autotune.metrics import Measurement, Metric

__all__ = ["Outcome", "classify"]


@dataclass(frozen=True)
class Outcome:
    """An experiment's end: status (ok/oom/error/timeout), metrics, a one-line reason, exit code, seconds."""

    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    exit_code: int | None = None
    seconds: float = 0.0
    missing_metric: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def measurement(self, metric: Metric) -> Measurement | None:
        return Measurement.from_metrics(self.metrics, metric.name) if self.ok else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        names = {"status", "metrics", "reason", "exit_code", "seconds", "missing_metric"}
        return cls(**{k: v for k, v in data.items() if k in names})


def classify(
    exit_code: int | None, report: TrialReport | str, timed_out: bool, metric: Metric, seconds: float, timeout: float
) -> Outcome:
    """The outcome (see the module docstring's table). ``report`` is a reason string when there is no report."""
    rep = report if isinstance(report, TrialReport) else None
    if timed_out and (rep is None or rep.status != "ok"):
        return Outcome("timeout", {}, f"no result within {timeout:g} s; its processes were killed", exit_code, seconds)
    if rep is None:
        why = (
            f"exited 0 without writing its report (${METRICS_ENV}); call elasticzero.autotune.report() or "
            "autotune.measure(timers) in the script"
            if exit_code == 0
            else f"exit code {exit_code} without a report; see its logs"
        )
        return Outcome("error", {}, why, exit_code, seconds)
    if rep.status in ("oom", "error"):
        return Outcome(rep.status, dict(rep.metrics), rep.message or rep.status, exit_code, seconds)
    if exit_code not in (0, None) and not timed_out:
        return Outcome("error", dict(rep.metrics), f"exit code {exit_code} after reporting ok", exit_code, seconds)
    if Measurement.from_metrics(rep.metrics, metric.name) is None:
        got = ", ".join(sorted(rep.metrics)) or "nothing"
        why = f"the report has no metric {metric.name!r} (reported: {got})"
        return Outcome("error", dict(rep.metrics), why, exit_code, seconds, missing_metric=True)
    why = "reported ok, then hung: killed at the timeout" if timed_out else ""
    return Outcome("ok", dict(rep.metrics), why, exit_code, seconds)
