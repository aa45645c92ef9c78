"""The floor of step-time drag: what any low-priority background work costs a 2-rank training loop on this machine.

Two gloo ranks train the ~29.5M-parameter GPT of ``examples/gpt.py`` under ``ZeroStage2`` (as
``bench/checkpoint_bench.py`` does) with no checkpoint at all. In each phase every rank starts one background process
under ``SCHED_IDLE`` (what ``Checkpointer``'s writer thread runs under by default) that loops one kind of work, and
the ranks time ``--steps`` steps; the phases rotate per round (A B C …) and "none" (no background process) is the
baseline. Kinds:

- ``cpu``: a pure-Python loop (no memory traffic);
- ``mem``: ``copy_`` of a 50 MB tensor over and over (memory bandwidth);
- ``write``: ``torch.save`` of 150 tensors (~168 MB) into a file through the checksumming stream, ``fsync``,
  unlink: the bytes and syscalls of one rank's async checkpoint write, in another process (no GIL shared with
  training, none of DCP's planning or collectives);
- ``paced``: the same write at ``--paced-mb-s`` MB/s at most (sleeping between items).

Prints the drag of each kind over "none" (slowest rank's median step / its median baseline step - 1), per round and
overall, with the machine load. If a checkpoint writer in its own process pays about what ``write`` costs, moving the
writer out of the training process cannot bring the drag below this floor. Not a test.

    OMP_NUM_THREADS=1 .venv/bin/python bench/background_drag_bench.py              # 6 rounds x 5 steps
    OMP_NUM_THREADS=1 .venv/bin/python bench/background_drag_bench.py --kinds cpu,write --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ez_ports import free_port  # tests/ on sys.path: the one free-port rule of tests and benchmarks

REPO = Path(__file__).resolve().parent.parent
KINDS = ("cpu", "mem", "write", "paced")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"background kinds, comma-separated (default all: {KINDS})")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each times every phase once (default 6)")
    p.add_argument("--steps", type=int, default=5, help="steps timed per phase and round (default 5)")
    p.add_argument("--size", default="bench", help="GPT size from examples/gpt.py (default bench, ~29.5M)")
    p.add_argument("--paced-mb-s", type=float, default=100.0, help="rate of the paced write (default 100 MB/s)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the ranks are killed")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--hog", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)  # the driver's scratch directory (removed by it)
    return p.parse_args(argv)


# -- background work (one process, SCHED_IDLE) -------------------------------------------------------------------------
def hog(kind: str, rate: float, scratch: Path) -> None:
    import torch

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    torch.set_num_threads(1)
    src, dst = torch.ones(50_000_000, dtype=torch.uint8), torch.zeros(50_000_000, dtype=torch.uint8)
    items = [torch.randn(280_000) for _ in range(150)]
    while True:  # until the rank kills it
        if kind == "cpu":
            sum(range(100_000))
        elif kind == "mem":
            dst.copy_(src)
        else:
            _write(scratch / f"hog-{os.getpid()}", items, rate if kind == "paced" else 0.0)


def _write(path: Path, items: list[Any], rate: float) -> None:
    import torch

    from elasticzero.checkpoint.writer import DigestStream

    t0, done = time.perf_counter(), 0
    with path.open("wb") as raw:
        out = DigestStream(raw)  # the stream the checkpoint writer wraps every file in
        for t in items:
            torch.save(t, out)
            done += t.numel() * t.element_size()
            if rate and (ahead := done / (rate * 1e6) - (time.perf_counter() - t0)) > 0:
                time.sleep(ahead)
        raw.flush()
        os.fsync(raw.fileno())
    path.unlink()


# -- one rank ---------------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, config_for, lm_loss, synthetic_batch  # noqa: I001 (examples/ on sys.path)
    from elasticzero.engine.zero.stage2 import ZeroStage2

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = config_for(args.size, block_size=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroStage2(model, torch.optim.AdamW, lr=1e-4)
    x, y = synthetic_batch(cfg, 2, 64, torch.Generator().manual_seed(1 + dist.get_rank()))

    def step() -> float:
        t0 = time.perf_counter()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step()
    phases = ["none", *args.kinds.split(",")]
    out: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for phase in phases[r % len(phases) :] + phases[: r % len(phases)]:
            out.setdefault(phase, []).append(statistics.median(_phase(phase, step, args)))
    dist.destroy_process_group()
    return out


def _phase(phase: str, step: Any, args: argparse.Namespace) -> list[float]:
    import torch.distributed as dist

    bg = None
    if phase != "none":
        argv = [sys.executable, __file__, "--hog", phase, "--paced-mb-s", str(args.paced_mb_s), "--dir", str(args.dir)]
        bg = subprocess.Popen(argv)
        time.sleep(1.0)  # past its imports and allocations
    try:
        dist.barrier()
        return [step() for _ in range(args.steps)]
    finally:
        if bg is not None:
            bg.kill()
            bg.wait()


# -- driver ----------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[dict[str, list[float]]]:
    scratch = Path(tempfile.mkdtemp(prefix="bgdrag_bench_"))
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    argv = [sys.executable, __file__, "--kinds", args.kinds, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    argv += ["--size", args.size, "--paced-mb-s", str(args.paced_mb_s), "--dir", str(scratch)]
    procs = [
        subprocess.Popen([*argv, "--worker", str(scratch / f"r{r}.json")], env=dict(env, RANK=str(r))) for r in range(2)
    ]
    try:
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
        return [json.loads((scratch / f"r{r}.json").read_text()) for r in range(2)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(scratch, ignore_errors=True)


def report(results: list[dict[str, list[float]]], load_before: tuple[float, ...], args: argparse.Namespace) -> None:
    med = statistics.median
    base = [med(r["none"]) for r in results]
    print(f"{args.size} GPT, 2 ranks, ZeroStage2 fp32 AdamW, {args.rounds} rounds x {args.steps} steps per phase")
    print(f"load average before: {load_before}, after: {os.getloadavg()}, cores: {os.cpu_count()}")
    print(f"baseline step (no background work): {max(base):.3f} s (slowest rank)\n")
    print("| background work (SCHED_IDLE, one per rank) | drag (slowest rank) | per round: min, median, max |")
    print("|---|---|---|")
    for kind in args.kinds.split(","):
        drag = max(med(r[kind]) / b for r, b in zip(results, base, strict=True)) - 1
        rounds = sorted(max(a / na, b / nb) - 1 for a, b, na, nb in zip(*(r[kind] for r in results),
                        *(r["none"] for r in results), strict=True))  # fmt: skip
        spread = ", ".join(f"{x * 100:+.1f}%" for x in (rounds[0], med(rounds), rounds[-1]))
        print(f"| {kind} | {drag * 100:+.1f}% | {spread} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hog:
        hog(args.hog, args.paced_mb_s, args.dir)
        return 0
    if args.worker:
        args.worker.write_text(json.dumps(worker(args)))
        return 0
    load_before = os.getloadavg()
    report(run(args), load_before, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
