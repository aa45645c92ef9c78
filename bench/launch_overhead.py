"""Launch overhead: ``elasticzero-launch`` vs plain ``torchrun`` for a 2-worker no-op job on this machine.

Both start 2 local workers of the same no-op script and wait for them; the runs alternate (A, B, A, B, …) so
drift on a shared machine hits both sides alike. Prints each command, every wall time, the medians and the ratio.

    .venv/bin/python bench/launch_overhead.py [--runs 7] [--nproc 2]

Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def commands(script: str, nproc: int) -> dict[str, list[str]]:
    """The two commands compared: our launcher (local backend → elasticzero-run) and torchrun --standalone."""
    return {
        "elasticzero-launch": [str(BIN / "elasticzero-launch"), "--nproc-per-node", str(nproc), script],
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), script],
    }


def timed(argv: list[str], cwd: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    elapsed = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{argv[0]} failed with {p.returncode}:\n{p.stderr[-2000:]}")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="runs per launcher (>= 5)")
    ap.add_argument("--nproc", type=int, default=2, help="workers per job")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ez-bench-") as tmp:
        script = str(Path(tmp) / "noop.py")
        Path(script).write_text("pass\n")
        cmds = commands(script, args.nproc)
        for name, argv in cmds.items():
            print(f"{name:>20}: {shlex.join(argv)}")
        for argv in cmds.values():  # warm the page cache once per side, not measured
            timed(argv, tmp)
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.runs):
            for name, argv in cmds.items():
                times[name].append(timed(argv, tmp))
    for name, ts in times.items():
        print(f"{name:>20}: median {statistics.median(ts):6.2f} s   runs " + " ".join(f"{t:.2f}" for t in ts))
    ez, tr = (statistics.median(times[n]) for n in ("elasticzero-launch", "torchrun"))
    print(f"{'ratio':>20}: elasticzero-launch / torchrun = {ez / tr:.2f}x  (+{ez - tr:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
