"""Stress: the live-loop cases (``tests/integration/live/test_live_loop.py``: a rank SIGKILLed or SIGSTOPped mid-step,
the survivors leaving the stuck collective for the announced round and resharding in memory) run again and again,
with all of the test's checks, to find races the single CI run would hide (a script, not collected).

    .venv/bin/python tests/stress/live_loop_stress.py --runs 10

Each run is a fresh pytest process; prints one line per run (seconds, result, the measured recovery times).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

TEST = Path(__file__).resolve().parents[1] / "integration" / "live" / "test_live_loop.py"


def one_run(timeout: float) -> tuple[float, bool, list[str]]:
    """The test file once: seconds, whether it passed, its timing lines."""
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "pytest", str(TEST), "-q", "-s", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(argv, env=dict(os.environ), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.monotonic() - t0, False, [f"timed out after {timeout:.0f} s"]
    lines = [line.lstrip(".") for line in done.stdout.splitlines() if "announcement ->" in line]
    return time.monotonic() - t0, done.returncode == 0, lines if done.returncode == 0 else [done.stdout[-2000:]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    failed = 0
    for i in range(args.runs):
        secs, ok, lines = one_run(args.timeout)
        failed += not ok
        print(f"run {i + 1}: {secs:.1f} s {'ok' if ok else 'FAILED'}", *(f"  {line}" for line in lines), sep="\n")
    print(f"{args.runs - failed}/{args.runs} runs passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
