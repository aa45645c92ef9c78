"""Launch overhead: ``elasticzero-launch`` vs plain ``torchrun`` for a 2-worker no-op job on this machine.

Both start 2 local workers of the same no-op script and wait for them; the runs alternate (A, B, A, B, …) so
drift on a shared machine hits both sides alike. Prints each command, every wall time, the medians, the ratio of the
medians to torchrun's and the median of the per-round ratios, and the machine's load average before and after. On a
shared machine the wall times scatter with the load; the CPU seconds of each run's whole process tree (launcher,
agent, shims, workers: ``RUSAGE_CHILDREN``) and the fastest run of each side are printed too, as load-robust views.

``--baseline-tree DIR`` adds a third side to the same alternation: ``elasticzero-launch`` importing elasticzero from
an older tree (``DIR/src`` and ``DIR/plugins`` first on ``PYTHONPATH``, e.g. ``git archive <commit> src plugins``
unpacked in ``DIR``), so a change is measured before/after under the same load.

    .venv/bin/python bench/launch_overhead.py [--runs 7] [--nproc 2] [--baseline-tree DIR]

Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
EZ, TORCHRUN, BASELINE = "elasticzero-launch", "torchrun", "ez-launch@baseline"


def commands(script: str, nproc: int, baseline: bool) -> dict[str, list[str]]:
    """The commands compared: our launcher (local backend: it execs elasticzero-run) and torchrun --standalone."""
    ez = [str(BIN / "elasticzero-launch"), "--nproc-per-node", str(nproc), script]
    cmds = {EZ: ez, TORCHRUN: [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), script]}
    if baseline:
        cmds[BASELINE] = ez
    return cmds


def environment(name: str, baseline_tree: Path | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # every side runs from bytecode caches written in the warm-up run, as an installed package does; with this set,
    # each run would recompile every module whose cache is stale (a tree being edited) and measure the compiler
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if name == BASELINE and baseline_tree is not None:
        paths = [str(baseline_tree / "src"), str(baseline_tree / "plugins"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the whole process tree, reaped) of one run."""
    cpu0, t0 = _cpu(), time.perf_counter()
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    elapsed, cpu = time.perf_counter() - t0, _cpu() - cpu0
    if p.returncode != 0:
        raise SystemExit(f"{argv[0]} failed with {p.returncode}:\n{p.stderr[-2000:]}")
    return elapsed, cpu


def report(times: dict[str, list[float]], cpus: dict[str, list[float]], load_before: tuple[float, ...]) -> None:
    for name, ts in times.items():
        print(f"{name:>20}: median {statistics.median(ts):6.2f} s   runs " + " ".join(f"{t:.2f}" for t in ts))
    for name, ts in times.items():
        print(f"{name:>20}: fastest {min(ts):5.2f} s   CPU median {statistics.median(cpus[name]):5.2f} s")
    tr = statistics.median(times[TORCHRUN])
    for name in (n for n in times if n != TORCHRUN):
        med = statistics.median(times[name])
        pairs = statistics.median(a / b for a, b in zip(times[name], times[TORCHRUN], strict=True))
        print(f"{'ratio':>20}: {name} / torchrun = {med / tr:.2f}x (+{med - tr:.2f} s); per-round median {pairs:.2f}x")
        fast, cpu = (
            min(times[name]) / min(times[TORCHRUN]),
            statistics.median(cpus[name]) / statistics.median(cpus[TORCHRUN]),
        )
        cpu_pairs = statistics.median(a / b for a, b in zip(cpus[name], cpus[TORCHRUN], strict=True))
        print(f"{'':>20}  fastest-run ratio {fast:.2f}x; CPU-median ratio {cpu:.2f}x; per-round CPU {cpu_pairs:.2f}x")
    load = " ".join(f"{x:.1f}" for x in load_before), " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{'load average':>20}: before {load[0]}; after {load[1]}  ({os.cpu_count()} cpus)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="runs per launcher (>= 5)")
    ap.add_argument("--nproc", type=int, default=2, help="workers per job")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="older tree with src/ and plugins/ to compare")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ez-bench-") as tmp:
        script = str(Path(tmp) / "noop.py")
        Path(script).write_text("pass\n")
        cmds = commands(script, args.nproc, args.baseline_tree is not None)
        envs = {name: environment(name, args.baseline_tree) for name in cmds}
        for name, argv in cmds.items():
            print(f"{name:>20}: {shlex.join(argv)}")
        for name, argv in cmds.items():  # warm the page cache once per side, not measured
            timed(argv, tmp, envs[name])
        times: dict[str, list[float]] = {name: [] for name in cmds}
        cpus: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.runs):
            for name, argv in cmds.items():
                wall, cpu = timed(argv, tmp, envs[name])
                times[name].append(wall)
                cpus[name].append(cpu)
    report(times, cpus, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
