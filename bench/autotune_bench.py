"""Autotuning quality and cost: the model-based tuner against the exhaustive grid and random search.

Not a test: nothing asserts; every figure printed comes from this run or from the table it names.

1. ``record`` (live): the grid over a 30-point space (stage 1-3 x micro batch 1-16 x 2 bucket sizes, 2 gloo ranks,
   the small GPT of ``examples/gpt.py`` trained by the real ZeRO engine and measured by ``PhaseTimers``) through
   ``elasticzero-autotune --tuner grid``; the tuner's ``results.csv`` is the recorded table.
2. ``simulate``: the tuners replayed on the table, per seed: each experiment's measured value is drawn from the
   recorded mean and per-step spread at the experiment's step count, its cost is the recorded launch overhead plus
   its steps at the recorded step time. Quality = the *recorded* throughput of the point a tuner chose / the grid's
   best; cost = its summed experiment seconds / the grid's. Random search gets the model-based tuner's cost as budget.
   Medians over the seeds.
3. ``confirm`` (live): one real model-based run; its choice and wall time next to the grid's.

::

    .venv/bin/python bench/autotune_bench.py record  --out bench/results/autotune_grid
    .venv/bin/python bench/autotune_bench.py simulate --table bench/results/autotune_grid/results.csv --seeds 21
    .venv/bin/python bench/autotune_bench.py confirm --table bench/results/autotune_grid/results.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPACE = {"stage": [1, 2, 3], "micro_batch": [1, 2, 4, 8, 16], "bucket_bytes": [262144, 8388608]}
BASE_CONFIG = {
    "zero": {"stage": 1},
    "micro_batch_size": 1,
    "accumulation_steps": 16,
    "train_batch_size": 32,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


# ------------------------------------------------------------------------------------------------ the trial


def trial(config: str, size: str, seq_len: int) -> int:
    """One experiment: the small GPT with the engine pieces the trial config describes."""
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist

    from elasticzero import autotune
    from elasticzero.config import build_pieces, load_config
    from gpt import GPT, config_for, lm_loss, num_params

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with autotune.trial():
        cfg = load_config(config, world_size=dist.get_world_size())
        torch.manual_seed(0)
        model = GPT(config_for(size, vocab_size=256, block_size=seq_len))
        pieces = build_pieces(model, cfg)
        opt, timers = pieces.optimizer, pieces.timers
        autotune.measure(timers, flops_per_sample=6.0 * num_params(model) * seq_len)
        gen = torch.Generator().manual_seed(dist.get_rank())
        while True:
            for _ in range(cfg.accumulation_steps):
                x = torch.randint(0, 256, (cfg.micro_batch_size, seq_len + 1), generator=gen)
                with timers.phase("fwd_bwd"):
                    (lm_loss(model(x[:, :-1]), x[:, 1:]) / cfg.accumulation_steps).backward()
            with timers.phase("step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if timers.count(samples=cfg.micro_batch_size * cfg.accumulation_steps):
                break
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ live runs


def _tune(out: Path, tuner: str, extra: dict, port: int) -> float:
    out.mkdir(parents=True, exist_ok=True)
    block = {"tuner": tuner, "space": SPACE, "warmup_steps": 2, "measure_steps": 9, "timeout": 600, **extra}
    (out / "cfg.json").write_text(json.dumps({**BASE_CONFIG, "autotuning": block}, indent=1))
    argv = [sys.executable, "-m", "elasticzero.autotune.cli", "--nproc-per-node", "2", "--master-port", str(port)]
    argv += ["--results-dir", str(out / "results"), __file__, "--trial", "--config", str(out / "cfg.json")]
    t0 = time.monotonic()
    subprocess.run(argv, cwd=out, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return time.monotonic() - t0


def record(out: Path, port: int) -> None:
    wall = _tune(out, "grid", {}, port)
    print(f"grid: {wall:.0f} s wall; table {out / 'results' / 'results.csv'}; load {os.getloadavg()}")


def confirm(table: Path, out: Path, port: int) -> None:
    rows = _table(table)
    grid_s = sum(r["seconds"] for r in rows.values())
    grid_best = max((r for r in rows.values() if r["ok"]), key=lambda r: r["throughput"])
    wall = _tune(out, "model_based", {}, port)
    runs = list(csv.DictReader(open(out / "results" / "results.csv")))  # every experiment, each round of each point
    longest = max(float(r["steps"]) for r in runs)
    best = max((r for r in runs if r["status"] == "ok" and float(r["steps"]) == longest),
               key=lambda r: float(r["throughput"]))  # fmt: skip
    point = "_".join(best["name"].split("_")[:4])
    live, recorded = float(best["throughput"]), rows[point]["throughput"]
    print(f"live model-based: {len(runs)} experiments, {wall:.0f} s wall, chose {point}")
    print(f"  its throughput: {live:.1f} samples/s live, {recorded:.1f} in the grid table")
    quality = rows[point]["throughput"] / grid_best["throughput"]
    print(f"  quality (its choice's recorded throughput / grid best {grid_best['point']}) {quality:.3f}")
    print(f"  cost (its experiment seconds / the grid's) {sum(float(r['seconds']) for r in runs) / grid_s:.3f}")
    print(f"  load {os.getloadavg()}")


# ------------------------------------------------------------------------------------------------ simulation


def _table(path: Path) -> dict[str, dict]:
    rows = {}
    for r in csv.DictReader(open(path)):
        point = "_".join(r["name"].split("_")[:4])  # z1_mb4_ga4_bkt262144 (a rung suffix dropped)
        ok = r["status"] == "ok"
        rows[point] = {
            "point": point,
            "ok": ok,
            "status": r["status"],
            "throughput": float(r["throughput"]) if ok else 0.0,
            "stdev": float(r.get("throughput_stdev") or 0.0),
            "latency": float(r["latency"]) if ok else 0.0,
            "steps": int(float(r["steps"])),
            "seconds": float(r["seconds"]),
        }
    return rows


def simulate(table: Path, seeds: int) -> None:
    from elasticzero.autotune.outcome import Outcome
    from elasticzero.autotune.space import Base, expand, parse_tuning
    from elasticzero.autotune.tuners import Candidate, best, make_tuner

    rows = _table(table)
    spec = parse_tuning({"space": SPACE, "warmup_steps": 2, "measure_steps": 9, "min_steps": 3, "eta": 3}, "bench")
    points = [p for p in expand(spec, Base(1, 1, 16, 32), 2)[0] if p.name in rows]
    grid_s = sum(rows[p.name]["seconds"] for p in points)
    grid_best = max(rows[p.name]["throughput"] for p in points)

    def run(cand: Candidate, rng: random.Random) -> Outcome:
        r = rows[cand.point.name]
        overhead = max(0.0, r["seconds"] - (2 + r["steps"]) * r["latency"])
        seconds = overhead + (2 + cand.steps) * r["latency"]
        if not r["ok"]:
            return Outcome(r["status"], {}, "recorded", 1, r["seconds"])
        value = rng.gauss(r["throughput"], r["stdev"] / math.sqrt(cand.steps))
        return Outcome("ok", {"throughput": value, "throughput_stdev": r["stdev"], "steps": cand.steps}, "", 0, seconds)

    quality, cost, rquality = [], [], []
    for seed in range(seeds):
        rng = random.Random(seed)
        tuner = make_tuner(spec)
        hist: list = []
        while cands := tuner.propose(points, hist):
            hist.append((cands[0], run(cands[0], rng)))
        spent = sum(o.seconds for _, o in hist)
        chosen = best(hist, spec.metric)
        quality.append(rows[chosen[0].point.name]["throughput"] / grid_best if chosen else 0.0)
        cost.append(spent / grid_s)
        order = list(points)
        random.Random(1000 + seed).shuffle(order)
        rhist: list = []
        for p in order:
            if sum(o.seconds for _, o in rhist) >= spent:
                break
            rhist.append((Candidate(p, 9), run(Candidate(p, 9), rng)))
        rbest = best(rhist, spec.metric)
        rquality.append(rows[rbest[0].point.name]["throughput"] / grid_best if rbest else 0.0)
    print(f"table {table}: {len(points)} points, grid {grid_s:.0f} s, best {grid_best:.1f} samples/s")
    print(f"model-based over {seeds} seeds: median quality {statistics.median(quality):.3f} "
          f"(min {min(quality):.3f}), median cost {statistics.median(cost):.3f} of the grid")  # fmt: skip
    print(f"random search at the same cost: median quality {statistics.median(rquality):.3f} (min {min(rquality):.3f})")


def main() -> int:
    if "--trial" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--trial", action="store_true")
        p.add_argument("--config", required=True)
        p.add_argument("--size", default="tiny")
        p.add_argument("--seq-len", type=int, default=64)
        a = p.parse_args()
        return trial(a.config, a.size, a.seq_len)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["record", "simulate", "confirm"])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "autotune_grid")
    p.add_argument("--table", type=Path)
    p.add_argument("--seeds", type=int, default=21)
    p.add_argument("--port", type=int, default=31700)
    a = p.parse_args()
    if a.mode == "record":
        record(a.out, a.port)
    elif a.mode == "simulate":
        simulate(a.table or a.out / "results" / "results.csv", a.seeds)
    else:
        confirm(a.table or a.out / "results" / "results.csv", a.out.with_name(a.out.name + "_confirm"), a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
