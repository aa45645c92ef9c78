"""Stress: the live-reshard cases (``tests/integration/live/live_reshard_worker.py``) run again and again — a rank
SIGKILLed while its peers go on, a new group formed beside a default group with a dead member, the copies stepped on
the copies' thread — to find races the single CI run would hide (a script, not collected).

    .venv/bin/python tests/stress/live_reshard_stress.py --runs 10

Each run is a fresh driver process (its own ports); prints one line per run (seconds, then the failed cases) and a
summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stress_runner import Run, main

WORKER = Path(__file__).resolve().parents[1] / "integration" / "engine" / "live_reshard_worker.py"


def one_run(timeout: float) -> Run:
    """Every case once, in a fresh directory: seconds, whether all were clean, the cases with a problem (or the
    driver's error)."""
    with tempfile.TemporaryDirectory(prefix="ez-live-reshard-") as tmp:
        t0 = time.monotonic()
        bad = problems(Path(tmp), timeout)
        return Run(time.monotonic() - t0, not bad, bad)


def problems(root: Path, timeout: float) -> list[str]:
    """Run the driver once under ``root``: the cases with a problem (or the driver's error); empty when clean."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, str(WORKER), str(root / "live")]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"driver timed out after {timeout:.0f} s"]
    if done.returncode != 0:
        return [f"driver exited {done.returncode}: {done.stderr[-600:]}"]
    return [f"{p.name}: {json.loads(p.read_text())}" for p in root.glob("live.*.rank*") if json.loads(p.read_text())]


if __name__ == "__main__":
    main(__doc__.split("\n\n")[0], one_run)
