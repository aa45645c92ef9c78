"""Stress: the live-reshard cases (``tests/integration/engine/live_reshard_worker.py``) run again and again — a rank
SIGKILLed while its peers go on, a new group formed beside a default group with a dead member, the copies stepped on
the replicator's thread — to find races the single CI run would hide (a script, not collected).

    .venv/bin/python tests/stress/live_reshard_stress.py --runs 10

Each run is a fresh driver process (its own ports); prints one line per run (seconds, failed cases) and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "integration" / "engine" / "live_reshard_worker.py"


def one_run(root: Path, timeout: float) -> tuple[float, list[str]]:
    """Run every case once; the cases with a problem (or the driver's error)."""
    out = root / "live"
    t0 = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            [sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return time.monotonic() - t0, [f"driver timed out after {timeout:.0f} s"]
    if done.returncode != 0:
        return time.monotonic() - t0, [f"driver exited {done.returncode}: {done.stderr[-600:]}"]
    bad = [f"{p.name}: {json.loads(p.read_text())}" for p in root.glob("live.*.rank*") if json.loads(p.read_text())]
    return time.monotonic() - t0, bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    failed = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ez-live-reshard-") as tmp:
            secs, bad = one_run(Path(tmp), args.timeout)
        failed += bool(bad)
        print(f"run {i + 1}: {secs:.1f} s {'ok' if not bad else 'FAILED ' + '; '.join(bad)}", flush=True)
    print(f"{args.runs - failed}/{args.runs} runs clean")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
