"""Stress: the live-loop cases (``tests/integration/live/test_live_loop.py``: a rank SIGKILLed or SIGSTOPped mid-step,
the survivors leaving the stuck collective for the announced round and resharding in memory) run again and again,
with all of the test's checks, to find races the single CI run would hide (a script, not collected).

    .venv/bin/python tests/stress/live_loop_stress.py --runs 10

Each run is a fresh pytest process; prints one line per run (seconds, result, the measured recovery times).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from stress_runner import Run, main

TEST = Path(__file__).resolve().parents[1] / "integration" / "live" / "test_live_loop.py"


def one_run(timeout: float) -> Run:
    """The test file once: seconds, whether it passed, its timing lines (or the end of its output)."""
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "pytest", str(TEST), "-q", "-s", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(argv, env=dict(os.environ), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Run(time.monotonic() - t0, False, [f"timed out after {timeout:.0f} s"])
    lines = [line.lstrip(".") for line in done.stdout.splitlines() if "announcement ->" in line]
    ok = done.returncode == 0
    return Run(time.monotonic() - t0, ok, lines if ok else [done.stdout[-2000:]])


if __name__ == "__main__":
    main(__doc__.split("\n\n")[0], one_run)
