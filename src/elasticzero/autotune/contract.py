"""The trial contract: how a training script tells the tuner how a configuration did.

The tuner names a file in the environment variable :data:`METRICS_ENV` (``ELASTICZERO_AUTOTUNE_METRICS``); the
script writes JSON there, atomically (temporary file + rename)::

    {"status": "ok" | "oom" | "error", "metrics": {"throughput": 812.5, "latency": 0.031, ...}, "message": "..."}

:func:`report` writes it (a no-op outside a tuning run), :func:`trial` turns an out-of-memory error (torch's
``OutOfMemoryError`` or a ``MemoryError``) into ``"oom"`` and any other exception into ``"error"``.
Success is decided by the exit status and this file, never by reading the output. ``"ok"`` is written by rank 0
only (its figures speak for the job); ``"oom"``/``"error"`` by whichever rank hit it (the rename makes
concurrent writers safe: one complete report wins).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from elasticzero.fileio import write_atomic

__all__ = ["METRICS_ENV", "STATUSES", "TrialReport", "is_oom", "read_report", "report", "trial"]

METRICS_ENV = "ELASTICZERO_AUTOTUNE_METRICS"
STATUSES = ("ok", "oom", "error")


@dataclass(frozen=True)
class TrialReport:
    """What a trial wrote: its status, its metrics and a message."""

    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""


def report(
    status: str = "ok",
    metrics: Mapping[str, float] | None = None,
    message: str = "",
    *,
    path: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Write this trial's report; returns the path, or ``None`` when not tuning (or not rank 0 for ``"ok"``).

    ``path`` defaults to ``$ELASTICZERO_AUTOTUNE_METRICS``. Metric values must be finite numbers.
    """
    if status not in STATUSES:
        raise ValueError(f"report status must be one of {STATUSES}, got {status!r}")
    target = path if path is not None else os.environ.get(METRICS_ENV)
    if not target or (status == "ok" and path is None and os.environ.get("RANK", "0") != "0"):
        return None
    clean = {str(k): float(v) for k, v in (metrics or {}).items()}
    bad = [k for k, v in clean.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"report: metrics {bad} are not finite numbers")
    body = json.dumps({"status": status, "metrics": clean, "message": str(message)}, sort_keys=True)
    return write_atomic(Path(target), body)


def read_report(path: str | os.PathLike[str]) -> TrialReport | str:
    """The report at ``path``, or a one-line reason why there is no usable one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return f"no report written to ${METRICS_ENV}"
    except (OSError, ValueError) as exc:
        return f"unreadable report {path}: {exc}"
    if not isinstance(data, dict) or data.get("status") not in STATUSES:
        return f"report {path}: 'status' must be one of {', '.join(STATUSES)}"
    metrics = data.get("metrics") or {}
    if not isinstance(metrics, dict):
        return f"report {path}: 'metrics' must be a mapping"
    nums = {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return TrialReport(data["status"], nums, str(data.get("message") or ""))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: a ``MemoryError`` or torch's ``OutOfMemoryError``."""
    if isinstance(exc, MemoryError):
        return True
    oom = _torch_oom_type()
    return oom is not None and isinstance(exc, oom)


def _torch_oom_type() -> type[BaseException] | None:
    import sys

    torch = sys.modules.get("torch")  # a script that never imported torch cannot raise torch's error
    return getattr(torch, "OutOfMemoryError", None) if torch is not None else None


@contextmanager
def trial() -> Iterator[None]:
    """Report ``"oom"`` or ``"error"`` for an exception escaping the block, then re-raise it."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        status = "oom" if is_oom(exc) else "error"
        report(status, message=f"{type(exc).__name__}: {exc}"[:2000])
        raise
