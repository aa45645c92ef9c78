"""Autotuning quality and cost: the model-based tuner against the exhaustive grid and random search.

Not a test: nothing asserts; every figure printed comes from this run or from the table it names.

1. ``record`` (live): the grid over a 30-point space (stage 1-3 x micro batch 1-16 x 2 bucket sizes, 2 gloo ranks,
   the small GPT of ``examples/gpt.py`` trained by the real ZeRO engine and measured by ``PhaseTimers``) through
   ``elasticzero-autotune --tuner grid``; the tuner's ``results.csv`` is the recorded table.
2. ``simulate``: the model-based tuner replayed on the table, per seed, as the live run pays: an experiment costs the
   table's median fixed cost (launch, imports, model build, warm-up: its seconds less its steps at its latency) plus
   its 2 + N steps at the point's recorded latency; its reported spread is the recorded per-step stdev as a sample of
   N steps would give it. Its measured value is drawn from the recorded mean under three noise models: the recorded
   per-step spread averaging out over N steps (``sd/sqrt(steps)``, optimistic: load bursts outlast a window); not
   averaging out (``sd``); and, given ``--live`` (a live run's ``results.csv``), ``sd/sqrt(steps)`` plus the
   run-to-run noise measured between that run and the table for the points both measured. Each model is run with the
   cost-aware tuner and with one that always halves. Quality = the *recorded* throughput of the point chosen / the
   grid's best; cost = the summed experiment seconds / the grid's. Random search gets the model-based tuner's cost as
   budget (9 steps each, the same noise). Medians (and min / max) over the seeds.
3. ``confirm`` (live): one real model-based run; its choice, experiment count and cost next to the grid's and next
   to the simulator's prediction (noise from ``--live`` if given, else ``sd``), and the run-to-run noise between
   it and the table.
4. ``synthetic``: the larger space — 3 stages x 5 micro batches x 2 bucket sizes x 2 precisions = 60 points — of a
   synthetic job (:class:`Job`: memory and step time from ZeRO's partitioning and traffic, out-of-memory regions at
   the lower stages and larger micro batches, noise per step and per run), its figures drawn per seed so the best
   point moves. Each experiment goes through the trial contract (:func:`synthetic_trial`: the trial config the tuner
   writes, the window in the environment, the report file read back and classified as a live one), one at a time.
   Quality = the true throughput of the point chosen / the best point's; time = the experiments' seconds / the
   grid's (every point once, out-of-memory ones included); random search gets the same seconds. Two cost regimes
   (start-up or steps dominate an experiment), each with the cost-aware tuner, one that always halves and one that
   never does; medians (and min / max) over the seeds.

::

    .venv/bin/python bench/autotune_bench.py record  --out bench/results/autotune_grid
    .venv/bin/python bench/autotune_bench.py simulate --table bench/results/autotune_grid/results.csv --seeds 21 \
        [--live bench/results/autotune_grid_confirm/results/results.csv]
    .venv/bin/python bench/autotune_bench.py confirm --table bench/results/autotune_grid/results.csv
    .venv/bin/python bench/autotune_bench.py synthetic --seeds 51
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
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
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


def confirm(table: Path, out: Path, port: int, seeds: int, live: Path | None) -> None:
    rows = _table(table)
    grid_s = sum(r["seconds"] for r in rows.values())
    grid_best = max((r for r in rows.values() if r["ok"]), key=lambda r: r["throughput"])
    wall = _tune(out, "model_based", {}, port)
    runs = list(csv.DictReader(open(out / "results" / "results.csv")))  # every experiment, each round of each point
    longest = max(float(r["steps"]) for r in runs)
    best = max((r for r in runs if r["status"] == "ok" and float(r["steps"]) == longest),
               key=lambda r: float(r["throughput"]))  # fmt: skip
    point = "_".join(best["name"].split("_")[:4])
    live_thr, recorded = float(best["throughput"]), rows[point]["throughput"]
    cost = sum(float(r["seconds"]) for r in runs) / grid_s
    print(f"live model-based: {len(runs)} experiments, {wall:.0f} s wall, chose {point}")
    print(f"  its throughput: {live_thr:.1f} samples/s live, {recorded:.1f} in the grid table")
    quality = rows[point]["throughput"] / grid_best["throughput"]
    print(f"  quality (its choice's recorded throughput / grid best {grid_best['point']}) {quality:.3f}")
    print(f"  cost (its experiment seconds / the grid's) {cost:.3f}")
    sigma = _run_noise(rows, live) if live is not None else None
    noise, label = ("live", f"sd/sqrt(steps) + {sigma:.3f}") if sigma is not None else ("correlated", "sd")
    pred = replay(table, seeds, noise, sigma or 0.0)
    med = statistics.median
    print(f"  simulator ({seeds} seeds, noise {label}): {med(pred['count']):.0f} experiments "
          f"(range {min(pred['count'])}-{max(pred['count'])}), cost {med(pred['cost']):.3f}; live: {len(runs)}, "
          f"{cost:.3f}")  # fmt: skip
    mine = _run_noise(rows, out / "results" / "results.csv")
    print("  run-to-run noise, this run vs the table: " + (f"{mine:.3f}" if mine is not None else "too few pairs"))
    print(f"  load {os.getloadavg()}")


def _exp_dir(results: Path, point: str) -> Path:
    """The experiment directory of ``point`` in a tuner's results (its longest measurement when it has several)."""
    dirs = sorted((results / "exps").glob(f"{point}*"), key=lambda d: json.loads((d / "metrics.json").read_text())
                  .get("metrics", {}).get("steps", 0) if (d / "metrics.json").exists() else -1)  # fmt: skip
    if not dirs:
        raise SystemExit(f"no experiment of {point} under {results / 'exps'}")
    return dirs[-1]


def _rerun(exp: Path, scratch: Path) -> float:
    """Run an experiment again with the exact argv the tuner used; its reported throughput."""
    metrics = scratch / "metrics.json"
    metrics.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ELASTICZERO_AUTOTUNE_METRICS": str(metrics)}
    argv = json.loads((exp / "argv.json").read_text())
    subprocess.run(argv, cwd=scratch, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads(metrics.read_text())["metrics"]["throughput"])


def duel(table: Path, chosen_results: Path, pairs: int) -> None:
    """The live quality of a tuner's choice: its experiment and the grid's best one re-run alternately (A B A B ...,
    the recorded argv of each), the ratio taken pair by pair; the median is printed with the load."""
    rows = _table(table)
    grid_best = max((r for r in rows.values() if r["ok"]), key=lambda r: r["throughput"])["point"]
    chosen = "_".join(_best_point(chosen_results).split("_")[:4])
    if chosen == grid_best:
        print(f"duel: the tuner chose the grid's best point {grid_best}: quality 1.000 by definition")
        return
    a, b = _exp_dir(chosen_results, chosen), _exp_dir(table.parent, grid_best)
    ratios, load0 = [], os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="at_duel_") as tmp:
        for i in range(pairs):
            ta, tb = _rerun(a, Path(tmp)), _rerun(b, Path(tmp))
            ratios.append(ta / tb)
            print(f"  pair {i + 1}: {chosen} {ta:.1f} / {grid_best} {tb:.1f} = {ta / tb:.3f}", flush=True)
    print(f"duel ({pairs} pairs, A B A B): chosen {chosen} / grid best {grid_best}: median ratio "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"load before {load0}, after {os.getloadavg()}")  # fmt: skip


def _best_point(results: Path) -> str:
    runs = list(csv.DictReader(open(results / "results.csv")))
    longest = max(float(r["steps"]) for r in runs)
    best = max((r for r in runs if r["status"] == "ok" and float(r["steps"]) == longest),
               key=lambda r: float(r["throughput"]))  # fmt: skip
    return best["name"]


# ------------------------------------------------------------------------------------------------ simulation


def _row(r: dict) -> dict:
    ok = r["status"] == "ok"
    return {
        "point": "_".join(r["name"].split("_")[:4]),  # z1_mb4_ga4_bkt262144 (a rung suffix dropped)
        "ok": ok,
        "status": r["status"],
        "throughput": float(r["throughput"]) if ok else 0.0,
        "stdev": float(r.get("throughput_stdev") or 0.0),
        "latency": float(r["latency"]) if ok else 0.0,
        "steps": int(float(r["steps"])),
        "seconds": float(r["seconds"]),
    }


def _table(path: Path) -> dict[str, dict]:
    rows = [_row(r) for r in csv.DictReader(open(path))]
    return {r["point"]: r for r in rows}


def _overhead(r: dict) -> float:
    """What an experiment's steps (2 warm-up + measured, at its latency) leave of its seconds: the fixed cost."""
    return r["seconds"] - (2 + r["steps"]) * r["latency"]


def _run_noise(rows: dict, live: Path | None) -> float | None:
    """Run-to-run relative noise from points measured both in the table and in a live run (any step count).

    The log ratio live/table per pair; its mean (the two sessions' load differs) is removed, and its spread is two
    runs' worth of noise: sd / sqrt(2).
    """
    if live is None:
        return None
    logs = [math.log(r["throughput"] / rows[p]["throughput"]) for p, r in _live_rows(live) if r["ok"] and p in rows]
    return statistics.stdev(logs) / math.sqrt(2) if len(logs) >= 3 else None


def _live_rows(path: Path) -> list[tuple[str, dict]]:
    return [("_".join(r["name"].split("_")[:4]), _row(r)) for r in csv.DictReader(open(path))]


class _Sim:
    """One replay of a tuner on the table: experiments cost the table's fixed cost plus their steps at the point's
    recorded latency; measured values are drawn from a noise model (see ``simulate``)."""

    def __init__(self, rows: dict, fixed: float, noise: str, sigma: float, rng: random.Random) -> None:
        self.rows, self.fixed, self.noise, self.sigma, self.rng = rows, fixed, noise, sigma, rng

    def run(self, cand):
        from elasticzero.autotune.outcome import Outcome

        r = self.rows[cand.point.name]
        seconds = self.fixed + (2 + cand.steps) * r["latency"]
        if not r["ok"]:
            return Outcome(r["status"], {}, "recorded", 1, r["seconds"])
        rel = r["stdev"] / r["throughput"]  # the recorded per-step spread, relative
        n = cand.steps
        sd = {"table": rel / math.sqrt(n), "correlated": rel, "live": math.hypot(self.sigma, rel / math.sqrt(n))}
        value = r["throughput"] * math.exp(self.rng.gauss(0.0, sd[self.noise]))
        reported = r["stdev"] * math.sqrt(self.rng.gammavariate((n - 1) / 2, 2) / (n - 1)) if n > 1 else 0.0
        metrics = {"throughput": value, "throughput_stdev": reported, "steps": n, "latency": r["latency"]}
        return Outcome("ok", metrics, "", 0, seconds)

    def tune(self, tuner, points) -> list:
        hist: list = []
        while cands := tuner.propose(points, hist):
            hist.append((cands[0], self.run(cands[0])))
        return hist

    def random_at(self, points, budget: float, order_seed: int, steps: int) -> list:
        from elasticzero.autotune.tuners import Candidate

        order = list(points)
        random.Random(order_seed).shuffle(order)
        hist: list = []
        for p in order:
            if sum(o.seconds for _, o in hist) >= budget:
                break
            hist.append((Candidate(p, steps), self.run(Candidate(p, steps))))
        return hist


def _spec():
    from elasticzero.autotune.space import parse_tuning

    return parse_tuning({"space": SPACE, "warmup_steps": 2, "measure_steps": 9, "min_steps": 3, "eta": 3}, "bench")


def replay(table: Path, seeds: int, noise: str, sigma: float, one_round_ratio: float | None = None) -> dict:
    """Per seed: the model-based tuner's experiment count, quality and cost, and random search's at that cost."""
    from elasticzero.autotune.space import Base, expand
    from elasticzero.autotune.tuners import ModelBasedTuner, best

    rows, spec = _table(table), _spec()
    points = [p for p in expand(spec, Base(1, 1, 16, 32), 2)[0] if p.name in rows]
    grid_s = sum(rows[p.name]["seconds"] for p in points)
    grid_best = max(rows[p.name]["throughput"] for p in points)
    fixed = statistics.median(_overhead(rows[p.name]) for p in points)
    out: dict = {"count": [], "quality": [], "cost": [], "random": [], "grid_s": grid_s, "best": grid_best}
    out |= {"points": len(points), "fixed": fixed}
    for seed in range(seeds):
        sim = _Sim(rows, fixed, noise, sigma, random.Random(seed))
        tuner = ModelBasedTuner(spec) if one_round_ratio is None else ModelBasedTuner(spec, one_round_ratio)
        hist = sim.tune(tuner, points)
        spent = sum(o.seconds for _, o in hist)
        chosen = best(hist, spec.metric)
        out["count"].append(len(hist))
        out["quality"].append(rows[chosen[0].point.name]["throughput"] / grid_best if chosen else 0.0)
        out["cost"].append(spent / grid_s)
        rbest = best(sim.random_at(points, spent, 1000 + seed, spec.measure_steps), spec.metric)
        out["random"].append(rows[rbest[0].point.name]["throughput"] / grid_best if rbest else 0.0)
    return out


def _line(label: str, r: dict) -> str:
    med = statistics.median
    return (
        f"{label:<50} {med(r['count']):>3.0f} ({min(r['count'])}-{max(r['count'])})  "
        f"{med(r['quality']):.3f} ({min(r['quality']):.3f})  {med(r['cost']):.3f} ({max(r['cost']):.3f})  "
        f"{med(r['random']):.3f} ({min(r['random']):.3f})"
    )


def simulate(table: Path, seeds: int, live: Path | None) -> None:
    """Both tuning modes under each noise model (see the module docstring), medians over ``seeds``."""
    sigma = _run_noise(_table(table), live)
    models = [("table", 0.0), ("correlated", 0.0)] + ([("live", sigma)] if sigma is not None else [])
    first = replay(table, 1, "table", 0.0)
    print(f"table {table}: {first['points']} points, grid {first['grid_s']:.0f} s, best {first['best']:.1f} samples/s")
    print(f"an experiment costs {first['fixed']:.2f} s (the median fixed cost) + its steps at the point's latency")
    if live is not None:
        got = f"{sigma:.3f}" if sigma is not None else "too few pairs"
        print(f"run-to-run noise (relative) from {live} vs the table: {got}")
    print(f"{seeds} seeds; median (min or max):")
    print(f"{'noise model: tuner':<50} {'experiments':<11}  {'quality':<13}  {'cost':<13}  random at that cost")
    for noise, sig in models:
        label = {"table": "sd/sqrt(steps)", "correlated": "sd (no averaging)", "live": f"sd/sqrt(steps) + {sig:.3f}"}
        print(_line(f"{label[noise]}: model-based", replay(table, seeds, noise, sig)))
        print(_line(f"{label[noise]}: model-based, always halving", replay(table, seeds, noise, sig, 0.0)))


# ------------------------------------------------------------------------------------------------ the synthetic space

#: the larger space: 3 stages x 5 micro batches x 2 bucket sizes x 2 precisions = 60 points
SYNTH_SPACE = {
    "stage": [1, 2, 3],
    "micro_batch": [1, 2, 4, 8, 16],
    "bucket_bytes": [262144, 8388608],
    "precision": ["fp32", "bf16"],
}
SYNTH_CONFIG = {"zero": {"stage": 1}, "micro_batch_size": 1, "accumulation_steps": 16, "train_batch_size": 128}
SYNTH_WORLD = 8
SYNTH_WINDOW = {"warmup_steps": 3, "measure_steps": 10, "min_steps": 3, "eta": 3}
#: an experiment's fixed cost (launch, imports, model build), seconds: start-up dominated, step dominated
SYNTH_REGIMES = {"start-up dominated": (20.0, 40.0), "step dominated": (2.0, 5.0)}


@dataclass(frozen=True)
class Job:
    """The synthetic job: a 1 B-parameter model on 8 data-parallel ranks, global batch 128; its figures are drawn per
    seed (so is where its best configuration lies).

    Memory per rank (GB): the model states ZeRO leaves on a rank (bytes per parameter: fp32 weights 4 + grads 4 +
    Adam 8; bf16 2 + 2 beside 12 of fp32 masters and Adam; stage 1 partitions the optimizer, 2 also the grads, 3 also
    the weights) + activations x micro batch (bf16 0.6 of fp32's) + two buckets; above ``capacity`` the trial reports
    ``oom`` in its first step. A step: ``accumulation`` micro-batches of compute (``sample_s`` a sample, bf16
    ``bf16_speed`` times that — faster or slower by the hardware — plus ``micro_s`` overhead per micro-batch) and the
    gradient traffic: stage 1 reduces once a step, stage 2 reduce-scatters every micro-batch and gathers the weights
    once, stage 3 also gathers the weights twice a micro-batch; bf16 halves the bytes; ``exposed`` of it is not hidden
    behind compute, a large bucket exposes ``late`` more, each bucket's collective costs ``call_s``. So micro batch
    and stage interact strongly (memory, traffic per micro-batch), bucket size and precision weakly (traffic volume,
    bucket count, activation memory).
    """

    capacity: float  # GB per rank
    sample_s: float  # compute seconds per sample, fp32
    bf16_speed: float  # bf16 compute time / fp32's
    micro_s: float  # overhead per micro-batch
    bandwidth: float  # GB/s between the ranks
    call_s: float  # latency of one bucket's collective
    late: float  # extra share of the traffic a large bucket exposes
    exposed: float  # share of the traffic not hidden behind compute
    fixed_s: float  # launch, imports, model build
    step_sd: float  # relative per-step spread
    run_sd: float  # relative run-to-run noise

    PARAMS = 1.0e9

    @classmethod
    def draw(cls, rng: random.Random, fixed: tuple[float, float]) -> Job:
        u = rng.uniform
        return cls(u(12.0, 16.0), u(0.05, 0.09), u(0.6, 1.15), u(0.01, 0.05), u(10.0, 40.0), u(5e-7, 5e-6),
                   u(0.05, 0.3), u(0.15, 0.4), u(*fixed), u(0.03, 0.08), u(0.01, 0.04))  # fmt: skip

    def memory(self, stage: int, micro: int, bucket: int, precision: str) -> float:
        bf16 = precision == "bf16"
        weights, grads, optim = (2.0, 2.0, 12.0) if bf16 else (4.0, 4.0, 8.0)
        n = SYNTH_WORLD
        per_param = weights / (n if stage >= 3 else 1) + grads / (n if stage >= 2 else 1) + optim / n
        return self.PARAMS * per_param / 1e9 + micro * (0.6 if bf16 else 1.0) + 2 * bucket / 1e9

    def step_seconds(self, stage: int, micro: int, accumulation: int, bucket: int, precision: str) -> float:
        bf16 = precision == "bf16"
        compute = accumulation * (micro * self.sample_s * (self.bf16_speed if bf16 else 1.0) + self.micro_s)
        volume = self.PARAMS * (2 if bf16 else 4) / 1e9  # GB of gradients
        passes = {1: 1.0, 2: 0.5 * accumulation + 0.5, 3: 1.5 * accumulation + 0.5}[stage]
        calls = passes * volume * 1e9 / bucket * self.call_s
        exposed = self.exposed + (self.late if bucket > 1 << 20 else 0.0)
        return compute + passes * volume / self.bandwidth * exposed + calls

    def seconds(self, fits: bool, step: float, steps: int) -> float:
        """An experiment's seconds: the fixed cost and its steps (warm-up included); an OOM dies in its first step."""
        return self.fixed_s + step * (steps if fits else 1)

    def throughput(self, p) -> float | None:
        """A point's true samples/s (``None``: it does not fit)."""
        if self.memory(p.stage, p.micro_batch, p.bucket_bytes, p.precision) > self.capacity:
            return None
        step = self.step_seconds(p.stage, p.micro_batch, p.accumulation, p.bucket_bytes, p.precision)
        return SYNTH_CONFIG["train_batch_size"] / step


def synthetic_trial(config: Mapping, job: Job, rng: random.Random, env: Mapping[str, str]) -> float:
    """One experiment of the synthetic job as a trial script runs it: its config (what the tuner wrote), its window
    from the environment, its report through ``autotune.report`` to ``$ELASTICZERO_AUTOTUNE_METRICS``; returns the
    seconds it took (the fixed cost plus its warm-up and measured steps; an OOM dies in its first step). The measured
    step time is the true one times the run-to-run noise and the per-step spread averaged over the steps; the
    reported spread is drawn as a sample of that many steps gives it."""
    from elasticzero import autotune

    zero = config["zero"]
    stage, micro, accum = zero["stage"], config["micro_batch_size"], config["accumulation_steps"]
    bucket, precision = zero["bucket_bytes"], config["precision"]["dtype"]
    step = job.step_seconds(stage, micro, accum, bucket, precision)
    path = env["ELASTICZERO_AUTOTUNE_METRICS"]
    warmup, steps = int(env["ELASTICZERO_AUTOTUNE_WARMUP_STEPS"]), int(env["ELASTICZERO_AUTOTUNE_MEASURE_STEPS"])
    seconds = job.seconds(job.memory(stage, micro, bucket, precision) <= job.capacity, step, warmup + steps)
    if job.memory(stage, micro, bucket, precision) > job.capacity:
        autotune.report("oom", message="OutOfMemoryError: synthetic", path=path)
        return seconds
    noise = math.hypot(job.run_sd, job.step_sd / math.sqrt(steps))
    latency = step * math.exp(rng.gauss(0.0, noise))
    spread = job.step_sd * math.sqrt(rng.gammavariate((steps - 1) / 2, 2) / (steps - 1)) if steps > 1 else 0.0
    thr = config["train_batch_size"] / latency
    metrics = {"throughput": thr, "throughput_stdev": thr * spread, "latency": latency,
               "latency_stdev": latency * spread, "steps": steps}  # fmt: skip
    autotune.report("ok", metrics, path=path)
    return seconds


def _synth_run(cand, job: Job, rng: random.Random, spec, report_path: Path):
    """An experiment of the synthetic job through the contract: the trial config the tuner writes, the window in the
    environment, the report file read back and classified as the tuner classifies a live one."""
    from elasticzero.autotune.contract import read_report
    from elasticzero.autotune.dialect import apply_point
    from elasticzero.autotune.outcome import classify

    config = apply_point(SYNTH_CONFIG, cand.point, False, SYNTH_CONFIG["train_batch_size"])
    env = {
        "ELASTICZERO_AUTOTUNE_METRICS": str(report_path),
        "ELASTICZERO_AUTOTUNE_WARMUP_STEPS": str(spec.warmup_steps),
        "ELASTICZERO_AUTOTUNE_MEASURE_STEPS": str(cand.steps),
    }
    report_path.unlink(missing_ok=True)
    seconds = synthetic_trial(config, job, rng, env)
    report = read_report(report_path)
    code = 0 if not isinstance(report, str) and report.status == "ok" else 1
    return classify(code, report, False, spec.metric, seconds, spec.timeout)


def _synth_tune(tuner, points, job: Job, rng: random.Random, spec, tmp: Path) -> list:
    """The tuner run to its end one experiment at a time (its first proposal each time), as on a one-host pool."""
    hist: list = []
    while cands := tuner.propose(points, hist):
        hist.append((cands[0], _synth_run(cands[0], job, rng, spec, tmp / "metrics.json")))
    return hist


def synth_replay(seeds: int, fixed: tuple[float, float], ratio: float | None = None) -> dict:
    """Per seed (a job drawn from the seed): the grid run to its end (every point once at ``measure_steps``; its
    seconds are the reference), the model-based tuner (``ratio``: its one-round threshold; ``None``: the default)
    and random search at the tuner's seconds. Quality = the true throughput of the point chosen / the best point's;
    cost = experiment seconds / the grid's."""
    from elasticzero.autotune.space import Base, expand, parse_tuning
    from elasticzero.autotune.tuners import GridTuner, ModelBasedTuner, best

    spec = parse_tuning({"space": SYNTH_SPACE, **SYNTH_WINDOW}, "bench")
    base = Base(1, 1, SYNTH_CONFIG["accumulation_steps"], SYNTH_CONFIG["train_batch_size"])
    points = expand(spec, base, SYNTH_WORLD)[0]
    out: dict = {"count": [], "quality": [], "cost": [], "random": [], "grid": [], "points": len(points), "ooms": []}
    shm = Path("/dev/shm")  # a report is written atomically (fsync): in memory when the machine has it
    with tempfile.TemporaryDirectory(prefix="at_synth_", dir=shm if shm.is_dir() else None) as tmp:
        for seed in range(seeds):
            job = Job.draw(random.Random(seed), fixed)
            true = {p: v for p in points if (v := job.throughput(p)) is not None}
            top = max(true.values())
            grid = _synth_tune(GridTuner(spec), points, job, random.Random(seed), spec, Path(tmp))
            grid_s = sum(o.seconds for _, o in grid)
            out["grid"].append(true[best(grid, spec.metric)[0].point] / top)  # its choice: one measurement each
            tuner = ModelBasedTuner(spec) if ratio is None else ModelBasedTuner(spec, ratio)
            hist = _synth_tune(tuner, points, job, random.Random(10_000 + seed), spec, Path(tmp))
            spent = sum(o.seconds for _, o in hist)
            chosen = best(hist, spec.metric)
            out["count"].append(len(hist))
            out["ooms"].append(len(points) - len(true))
            out["quality"].append(true.get(chosen[0].point, 0.0) / top if chosen else 0.0)
            out["cost"].append(spent / grid_s)
            rnd = _synth_random(points, spent, seed, job, spec, Path(tmp))
            out["random"].append(true.get(rnd, 0.0) / top if rnd else 0.0)
    return out


def _synth_random(points, budget: float, seed: int, job: Job, spec, tmp: Path):
    """Random search at the model-based tuner's cost: seeded order, full measurements, until the budget is spent."""
    from elasticzero.autotune.tuners import Candidate, best

    order = list(points)
    random.Random(1000 + seed).shuffle(order)
    hist: list = []
    rng = random.Random(20_000 + seed)
    for p in order:
        if sum(o.seconds for _, o in hist) >= budget:
            break
        cand = Candidate(p, spec.measure_steps)
        hist.append((cand, _synth_run(cand, job, rng, spec, tmp / "metrics.json")))
    found = best(hist, spec.metric)
    return found[0].point if found else None


def synthetic(seeds: int) -> None:
    """The 60-point synthetic space in both cost regimes, medians (and min or max) over ``seeds`` jobs."""
    med = statistics.median
    print(f"synthetic space: {' x '.join(str(len(v)) for v in SYNTH_SPACE.values())} points "
          f"({', '.join(SYNTH_SPACE)}), {SYNTH_WORLD} ranks, global batch {SYNTH_CONFIG['train_batch_size']}, "
          f"{seeds} seeds (a job drawn per seed); median (min or max):")  # fmt: skip
    print(f"{'regime: tuner':<44} {'experiments':<12} {'grid time':<15} {'quality':<15} {'>= 0.95':<8} random")
    for regime, fixed in SYNTH_REGIMES.items():
        for label, ratio in (("model-based", None), ("always halving", 0.0), ("one round", math.inf)):
            r = synth_replay(seeds, fixed, ratio)
            c, q, t, rnd = r["count"], r["quality"], r["cost"], r["random"]
            share = sum(x >= 0.95 for x in q) / len(q)
            print(f"{regime + ': ' + label:<44} {med(c):>2.0f}/{r['points']} ({min(c)}-{max(c)}) "
                  f"{med(t):.3f} ({max(t):.3f})  {med(q):.3f} ({min(q):.3f})  {share:>5.0%}    "
                  f"{med(rnd):.3f} ({min(rnd):.3f})")  # fmt: skip
        g = r["grid"]
        print(f"{regime}: the grid's own choice {med(g):.3f} ({min(g):.3f}), >= 0.95 in "
              f"{sum(x >= 0.95 for x in g) / len(g):.0%}; out-of-memory points per job {med(r['ooms']):.0f} "
              f"({min(r['ooms'])}-{max(r['ooms'])})")  # fmt: skip


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
    p.add_argument("mode", choices=["record", "simulate", "confirm", "duel", "synthetic"])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "autotune_grid")
    p.add_argument("--table", type=Path)
    p.add_argument("--seeds", type=int, default=21)
    p.add_argument("--live", type=Path, help="a live run's results.csv: the run-to-run noise is estimated from it")
    p.add_argument("--port", type=int, default=31700)
    p.add_argument("--chosen", type=Path, help="duel: the results directory of the tuner run whose choice is tested")
    p.add_argument("--pairs", type=int, default=3, help="duel: A B pairs (default 3)")
    a = p.parse_args()
    if a.mode == "record":
        record(a.out, a.port)
    elif a.mode == "duel":
        duel(a.table or a.out / "results" / "results.csv", a.chosen, a.pairs)
    elif a.mode == "synthetic":
        synthetic(a.seeds)
    elif a.mode == "simulate":
        simulate(a.table or a.out / "results" / "results.csv", a.seeds, a.live)
    else:
        out = a.out.with_name(a.out.name + "_confirm")
        confirm(a.table or a.out / "results" / "results.csv", out, a.port, a.seeds, a.live)
    return 0


if __name__ == "__main__":
    sys.exit(main())
