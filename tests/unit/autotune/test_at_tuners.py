"""Outcome classification, the trial contract, the measuring window and the tuners (pure, no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from elasticzero import autotune
from elasticzero.autotune.contract import METRICS_ENV, TrialReport, read_report
from elasticzero.autotune.metrics import get_metric
from elasticzero.autotune.outcome import Outcome, classify
from elasticzero.autotune.space import Base, expand, parse_tuning
from elasticzero.autotune.tuners import (
    Candidate,
    CostModel,
    ModelBasedTuner,
    best,
    estimate_cost,
    make_tuner,
    pruned_by_oom,
    stalled,
)
from elasticzero.autotune.window import MeasureWindow
from elasticzero.engine.timers import PhaseTimers

THR = get_metric("throughput")

# ------------------------------------------------------------------------------------------------ outcome


@pytest.mark.parametrize(
    ("code", "report", "timed_out", "status", "reason"),
    [
        (0, TrialReport("ok", {"throughput": 5.0}), False, "ok", ""),
        (1, TrialReport("oom", {}, "CUDA out of memory"), False, "oom", "CUDA out of memory"),
        (0, TrialReport("error", {}, "bad"), False, "error", "bad"),
        (1, TrialReport("ok", {"throughput": 5.0}), False, "error", "exit code 1 after reporting ok"),
        (0, "no report written", False, "error", "exited 0 without writing its report"),
        (7, "no report written", False, "error", "exit code 7 without a report"),
        (137, "no report written", True, "timeout", "no result within 30 s"),
        (137, TrialReport("ok", {"throughput": 5.0}), True, "ok", "reported ok, then hung"),
        (0, TrialReport("ok", {"latency": 5.0}), False, "error", "the report has no metric 'throughput'"),
    ],
)
def test_classify(code: int, report, timed_out: bool, status: str, reason: str) -> None:
    out = classify(code, report, timed_out, THR, 1.0, 30.0)
    assert out.status == status and reason in out.reason
    assert Outcome.from_json(json.loads(json.dumps(out.to_json()))) == out


# ------------------------------------------------------------------------------------------------ contract


def test_report_is_atomic_json_and_rank0_only_for_ok(tmp_path, monkeypatch) -> None:
    target = tmp_path / "m.json"
    monkeypatch.setenv(METRICS_ENV, str(target))
    monkeypatch.setenv("RANK", "1")
    assert autotune.report("ok", {"throughput": 1.0}) is None and not target.exists()
    assert autotune.report("oom", message="boom") == target  # any rank may report a failure
    assert read_report(target) == TrialReport("oom", {}, "boom")
    monkeypatch.setenv("RANK", "0")
    autotune.report("ok", {"throughput": 2, "latency": 0.5})
    assert json.loads(target.read_text()) == {
        "status": "ok",
        "metrics": {"latency": 0.5, "throughput": 2.0},
        "message": "",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temp file left behind
    with pytest.raises(ValueError, match="not finite"):
        autotune.report("ok", {"throughput": float("inf")})
    with pytest.raises(ValueError, match="status must be one of"):
        autotune.report("fine")
    monkeypatch.delenv(METRICS_ENV)
    assert autotune.report("ok", {"throughput": 1.0}) is None  # not tuning: a no-op


def test_read_report_reasons(tmp_path) -> None:
    assert "no report written" in read_report(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    assert "unreadable report" in read_report(tmp_path / "bad.json")
    (tmp_path / "s.json").write_text('{"status": "great"}')
    assert "'status' must be one of ok, oom, error" in read_report(tmp_path / "s.json")


@pytest.mark.parametrize(
    ("exc", "status"),
    [(torch.OutOfMemoryError("CUDA out of memory"), "oom"), (MemoryError(), "oom"), (ValueError("x"), "error")],
)
def test_trial_turns_exceptions_into_reports(tmp_path, monkeypatch, exc: BaseException, status: str) -> None:
    monkeypatch.setenv(METRICS_ENV, str(tmp_path / "m.json"))
    with pytest.raises(type(exc)), autotune.trial():
        raise exc
    assert read_report(tmp_path / "m.json").status == status


# ------------------------------------------------------------------------------------------------ window


def test_measure_window_reports_and_stops(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(METRICS_ENV, str(tmp_path / "m.json"))
    monkeypatch.setenv("ELASTICZERO_AUTOTUNE_WARMUP_STEPS", "2")
    monkeypatch.setenv("ELASTICZERO_AUTOTUNE_MEASURE_STEPS", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    timers = PhaseTimers()
    window = autotune.measure(timers, flops_per_sample=10.0)
    assert isinstance(window, MeasureWindow) and timers.enabled
    stops = []
    for _ in range(6):
        with timers.phase("step"):
            sum(range(1000))
        stops.append(timers.count(samples=4))
    assert stops == [False, False, False, False, True, True]  # 2 warm-up + 3 measured, then stop
    rep = read_report(tmp_path / "m.json")
    assert rep.status == "ok" and rep.metrics["steps"] == 3.0
    m = rep.metrics
    assert m["throughput"] == pytest.approx(3 * 4 * 2 / (3 * m["latency"]))  # every rank's samples
    assert m["flops"] == pytest.approx(m["throughput"] * 10.0) and m["memory"] > 0
    monkeypatch.delenv(METRICS_ENV)
    assert autotune.measure(PhaseTimers()) is None


# ------------------------------------------------------------------------------------------------ tuners


BASE = Base(1, 1, 8, 8)


def _points(space: dict):
    return expand(parse_tuning({"space": space}, "x"), BASE, 1)[0]


def _ok(value: float, stdev: float = 0.0, steps: int = 10) -> Outcome:
    return Outcome("ok", {"throughput": value, "throughput_stdev": stdev, "steps": steps})


def test_grid_and_random() -> None:
    points = _points({"stage": [1, 2], "micro_batch": [1, 2, 4, 8]})
    grid = make_tuner(parse_tuning({"tuner": "grid"}, "x"))
    assert [c.point for c in grid.propose(points, [])] == points
    done = [(Candidate(points[0], 10), _ok(1.0))]
    assert points[0] not in [c.point for c in grid.propose(points, done)]
    rnd = make_tuner(parse_tuning({"tuner": "random", "seed": 3}, "x"))
    first = rnd.propose(points, [])
    assert len(first) == 2 and first == rnd.propose(points, [])  # a quarter, reproducible from the seed
    assert make_tuner(parse_tuning({"tuner": "random", "seed": 4, "max_trials": 8}, "x")).propose(points, []) != []


def test_oom_prunes_larger_micro_batches_and_lower_stages() -> None:
    points = _points({"stage": [1, 2, 3], "micro_batch": [1, 2, 4, 8], "precision": ["fp32", "bf16"]})
    oom = next(p for p in points if (p.stage, p.micro_batch, p.precision) == (2, 4, "fp32"))
    pruned = pruned_by_oom(points, [(Candidate(oom, 3), Outcome("oom"))])
    names = sorted(p.name for p in pruned)
    assert names == ["z1_mb4_ga2_fp32", "z1_mb8_ga1_fp32", "z2_mb8_ga1_fp32"]  # not stage 3, not bf16


def test_model_based_descends_from_the_largest_micro_batch_then_halves() -> None:
    spec = parse_tuning(
        {"space": {"stage": [1, 2], "micro_batch": [1, 2, 4]}, "min_steps": 2, "measure_steps": 18, "eta": 3}, "x"
    )
    points = _points({"stage": [1, 2], "micro_batch": [1, 2, 4]})
    tuner = ModelBasedTuner(spec)

    def names(cands: list[Candidate]) -> list[tuple[str, int]]:
        return [(c.point.name, c.steps) for c in cands]

    start = tuner.propose(points, [])
    assert names(start) == [("z1_mb4_ga2", 18)]  # lowest stage, largest micro batch; full length until a success
    hist = [(start[0], Outcome("oom"))]  # rules out nothing else at stage 1 (no larger micro batch)
    nxt = tuner.propose(points, hist)
    assert names(nxt) == [("z1_mb2_ga4", 18)]
    hist.append((nxt[0], _ok(20.0)))  # no seconds, no latency: the cost is unknown, so successive halving
    near = tuner.propose(points, hist)  # micro step, stage step, then one stage up with a larger micro batch
    assert names(near) == [("z1_mb1_ga8", 2), ("z2_mb2_ga4", 2), ("z2_mb4_ga2", 2)]
    hist += [(near[0], _ok(10.0)), (near[1], _ok(25.0)), (near[2], _ok(30.0))]
    final = tuner.propose(points, hist)  # z2 mb4 is a local optimum: halving among round 0's results
    assert names(final) == [("z2_mb4_ga2", 6), ("z2_mb2_ga4", 6)]  # z1 mb2 (18 steps, 20.0) is cut
    assert "z2_mb1_ga8" not in {c.point.name for c, _ in hist}  # never measured
    hist += [(final[0], _ok(31.0, steps=6)), (final[1], _ok(24.0, steps=6))]
    last = tuner.propose(points, hist)  # a clear winner, measured as long as z1 mb2 was, for best() to compare
    assert names(last) == [("z2_mb4_ga2", 18)]
    hist.append((last[0], _ok(30.0, steps=18)))
    assert tuner.propose(points, hist) == []
    assert best(hist, THR)[0].point.name == "z2_mb4_ga2"


def test_model_based_oom_rules_out_before_running() -> None:
    spec = parse_tuning({"space": {"stage": [1, 2, 3], "micro_batch": [1, 2, 4, 8]}, "min_steps": 2}, "x")
    points = _points({"stage": [1, 2, 3], "micro_batch": [1, 2, 4, 8]})
    tuner = ModelBasedTuner(spec)
    hist = [(Candidate(p, 2), Outcome("oom")) for p in points if (p.stage, p.micro_batch) == (2, 4)]
    hist.append((Candidate(next(p for p in points if (p.stage, p.micro_batch) == (1, 2)), 2), _ok(5.0)))
    proposed = {c.point.name for c in tuner.propose(points, hist)}
    assert "z1_mb4_ga2" not in proposed and "z2_mb4_ga2" not in proposed  # OOM at z2 mb4: z1 mb4 cannot fit
    assert proposed == {"z1_mb1_ga8", "z2_mb2_ga4"}


def test_successive_halving_keeps_noisy_ties() -> None:
    spec = parse_tuning({"space": {"micro_batch": [1, 2, 4, 8]}, "min_steps": 2, "measure_steps": 6, "eta": 3}, "x")
    points = _points({"micro_batch": [1, 2, 4, 8]})
    tuner = ModelBasedTuner(spec)
    r0 = [Candidate(p, 2) for p in points]  # round 0 as the descent would leave it: every point measured
    values = {1: (100.0, 1.0), 2: (99.0, 30.0), 4: (50.0, 1.0), 8: (10.0, 1.0)}  # mb2 is within noise of mb1
    hist = [(c, _ok(*values[c.point.micro_batch], steps=2)) for c in r0]
    r1 = tuner.propose(points, hist)
    assert sorted(c.point.micro_batch for c in r1) == [1, 2] and {c.steps for c in r1} == {6}
    hist += [(r1[0], _ok(90.0, steps=6)), (r1[1], _ok(95.0, steps=6))]
    assert tuner.propose(points, hist) == []
    assert best(hist, THR)[0] == r1[1]  # the longest measurement decides, not round 0's figures


def test_early_stopping() -> None:
    p = _points({"micro_batch": [1]})[0]
    hist = [(Candidate(p, 1), _ok(v)) for v in (10.0, 20.0, 20.1, 19.0, 5.0)]
    assert stalled(hist, THR, patience=3, noise=0.01) and not stalled(hist, THR, patience=4, noise=0.01)
    assert not stalled(hist, THR, patience=None, noise=0.01)
    assert not stalled([(Candidate(p, 1), Outcome("oom"))] * 5, THR, patience=2, noise=0.01)  # no best yet


# ------------------------------------------------------------------------------------------------ cost-aware


def _run(value: float, seconds: float, steps: int, latency: float | None = 0.04) -> Outcome:
    metrics = {"throughput": value, "throughput_stdev": value / 10, "steps": float(steps)}
    return Outcome("ok", metrics | ({"latency": latency} if latency is not None else {}), seconds=seconds)


def test_estimate_cost_from_latency_or_from_two_step_counts() -> None:
    p, q = _points({"micro_batch": [1, 2]})
    assert estimate_cost([], 2) is None
    assert estimate_cost([(Candidate(p, 9), Outcome("oom", seconds=5.0))], 2) is None  # failures say nothing
    assert estimate_cost([(Candidate(p, 9), _run(1.0, 9.3, 9, latency=None))], 2) is None  # one step count, no rate
    cost = estimate_cost([(Candidate(p, 9), _run(1.0, 9.44, 9)), (Candidate(q, 9), _run(1.0, 9.04, 9))], 2)
    assert cost == CostModel(pytest.approx(8.8), pytest.approx(0.04))  # median of 9.44 - 11 x 0.04 and 9.04 - 0.44
    slope = estimate_cost([(Candidate(p, 3), _run(1.0, 7.0, 3, None)), (Candidate(q, 9), _run(1.0, 13.0, 9, None))], 2)
    assert slope == CostModel(pytest.approx(2.0), pytest.approx(1.0))  # seconds = 2 + 1 x (2 warm-up + steps)
    assert slope.seconds(11) == pytest.approx(13.0)


def _descent(tuner: ModelBasedTuner, points, values: dict[int, float], seconds) -> list:
    """Run the tuner to the end on known values; ``seconds(steps)`` is each experiment's cost."""
    hist: list = []
    while cands := tuner.propose(points, hist):
        c = cands[0]
        hist.append((c, _run(values[c.point.micro_batch], seconds(c.steps), c.steps, latency=seconds(1) - seconds(0))))
    return hist


@pytest.mark.parametrize(
    ("mb8", "runs", "chosen"),
    [
        # measure_steps from the start (until a success gives the cost, then because of it); nothing re-launched
        (20.0, [(8, 9, 0), (4, 9, 0), (2, 9, 0)], 4),
        (50.0, [(8, 9, 0), (4, 9, 0)], 8),
    ],
)
def test_fixed_cost_dominates_one_round_at_measure_steps(mb8: float, runs: list, chosen: int) -> None:
    space = {"micro_batch": [1, 2, 4, 8]}
    spec = parse_tuning({"space": space, "warmup_steps": 2, "min_steps": 3, "measure_steps": 9, "eta": 3}, "x")
    points = _points(space)
    tuner = ModelBasedTuner(spec)
    hist = _descent(tuner, points, {1: 10.0, 2: 30.0, 4: 40.0, 8: mb8}, lambda s: 9.0 + 0.04 * (2 + s))
    assert tuner.one_round(hist) is True  # 9.44 s at 9 steps vs 9.2 s at 3: 1.03x
    assert [(c.point.micro_batch, c.steps, c.rung) for c, _ in hist] == runs
    assert best(hist, THR)[0].point.micro_batch == chosen


def test_step_cost_dominates_successive_halving_reuses_longer_measurements() -> None:
    space = {"micro_batch": [1, 2, 4, 8]}
    spec = parse_tuning({"space": space, "warmup_steps": 2, "min_steps": 3, "measure_steps": 9, "eta": 3}, "x")
    points = _points(space)
    tuner = ModelBasedTuner(spec)
    values = {1: 10.0, 2: 30.0, 4: 40.0, 8: 39.0}
    hist = _descent(tuner, points, values, lambda s: 1.0 + 1.0 * (2 + s))
    assert tuner.one_round(hist) is False  # 12 s at 9 steps vs 6 s at 3: 2x
    runs = [(c.point.micro_batch, c.steps, c.rung) for c, _ in hist]
    # the first success in full (it tells the cost), the other probes at min_steps, then the best and its tie at 9 —
    # except mb8, which already has its 9 steps
    assert runs == [(8, 9, 0), (4, 3, 0), (2, 3, 0), (4, 9, 1)]
    assert best(hist, THR)[0].point.micro_batch == 4
    assert ModelBasedTuner(spec, one_round_ratio=2.5).one_round(hist) is True  # the threshold is the constructor's


def test_one_round_after_a_halving_start_measures_survivors_once_at_measure_steps() -> None:
    space = {"micro_batch": [1, 2, 4]}
    spec = parse_tuning({"space": space, "warmup_steps": 0, "min_steps": 2, "measure_steps": 18, "eta": 3}, "x")
    points = _points(space)
    p1, p2, p4 = points
    tuner = ModelBasedTuner(spec)
    # round 0 ran at min_steps (no rate known then); now the costs say the fixed part dominates
    hist = [(Candidate(p, 2), _run(v, 30.0, 2, latency=0.01)) for p, v in ((p4, 50.0), (p2, 49.0), (p1, 10.0))]
    assert tuner.one_round(hist) is True
    again = tuner.propose(points, hist)  # noise-aware cut (mb2 ties mb4 within 2 standard errors), straight to 18
    assert {(c.point.micro_batch, c.steps, c.rung) for c in again} == {(4, 18, 1), (2, 18, 1)}
    hist += [(c, _run(50.0, 30.0, 18, latency=0.01)) for c in again]
    assert tuner.propose(points, hist) == []
