"""elasticzero.autotune: find the best ZeRO configuration for a script by running it (see docs/autotuning.md).

For training scripts (the trial contract; importing this package loads no torch)::

    from elasticzero import autotune
    autotune.report("ok", {"throughput": 812.5})      # or let PhaseTimers do it: autotune.measure(timers)
    with autotune.trial(): train()                     # an OOM becomes status "oom", any other error "error"

The tuner itself: ``elasticzero-autotune`` / ``elasticzero-launch --autotuning tune|run``
(:mod:`elasticzero.autotune.cli`).
"""

from __future__ import annotations

from elasticzero.autotune.contract import METRICS_ENV, TrialReport, is_oom, read_report, report, trial
from elasticzero.autotune.window import MeasureWindow, measure, window_steps

__all__ = [
    "METRICS_ENV",
    "MeasureWindow",
    "TrialReport",
    "is_oom",
    "measure",
    "read_report",
    "report",
    "trial",
    "window_steps",
]
