"""The model-based tuner's local search (``elasticzero.autotune.search``) and its cost rules, on known landscapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from elasticzero.autotune.metrics import get_metric
from elasticzero.autotune.outcome import Outcome
from elasticzero.autotune.search import descend, screened
from elasticzero.autotune.space import Base, Point, expand, parse_tuning
from elasticzero.autotune.tuners import (
    Candidate,
    ModelBasedTuner,
    best,
    default_one_round_ratio,
    needs_more_memory,
    pruned_by_oom,
)

THR = get_metric("throughput")
#: 3 stages x 5 micro batches x 2 buckets x 2 precisions = 60 points
SPACE = {
    "stage": [1, 2, 3],
    "micro_batch": [1, 2, 4, 8, 16],
    "bucket_bytes": [1024, 4096],
    "precision": ["fp32", "bf16"],
}
WINDOW = {"warmup_steps": 2, "min_steps": 3, "measure_steps": 9, "eta": 3}


def _points(space: dict = SPACE) -> list[Point]:
    return expand(parse_tuning({"space": space}, "x"), Base(1, 1, 16, 16), 1)[0]


def _at(points: list[Point], stage: int, micro: int, bucket: int = 1024, precision: str = "bf16") -> Point:
    return next(
        p for p in points if (p.stage, p.micro_batch, p.bucket_bytes, p.precision) == (stage, micro, bucket, precision)
    )


def _ok(value: float, steps: int = 9, seconds: float = 0.0, latency: float = 0.04) -> Outcome:
    return Outcome("ok", {"throughput": value, "steps": float(steps), "latency": latency}, seconds=seconds)


def _oom_region(p: Point) -> bool:
    """Stage 1 fits micro batches up to 4, stage 2 up to 8, stage 3 all (any bucket, any precision)."""
    return p.micro_batch > {1: 4, 2: 8, 3: 16}[p.stage]


def _separable(p: Point) -> float:
    """Micro batch and stage interact (larger batches amortise a stage's traffic); bucket and precision multiply."""
    core = p.micro_batch / (p.micro_batch + 2) * (1 - 0.05 * (p.stage - 1))
    return core * (1.03 if p.bucket_bytes == 4096 else 1.0) * (1.2 if p.precision == "bf16" else 1.0)


def _tune(value: Callable[[Point], float], oom: Callable[[Point], bool]) -> list[tuple[Candidate, Outcome]]:
    """The tuner to its end, one experiment at a time; an experiment costs 30 s + 0.04 s a step (start-up dominates)."""
    spec = parse_tuning({"space": SPACE, **WINDOW}, "x")
    tuner, points, hist = ModelBasedTuner(spec), _points(), []
    while cands := tuner.propose(points, hist):
        c = cands[0]
        seconds = 30.0 + 0.04 * (2 + c.steps)
        hist.append((c, Outcome("oom", seconds=seconds) if oom(c.point) else _ok(value(c.point), c.steps, seconds)))
    return hist


def test_separable_space_optimum_within_a_quarter_of_the_grid() -> None:
    hist = _tune(_separable, _oom_region)
    points = [p for p in _points() if not _oom_region(p)]
    top = max(points, key=_separable)
    assert best(hist, THR)[0].point == top
    assert len(hist) <= len(_points()) / 4, [c.point.name for c, _ in hist]  # the goal: at most a quarter of the grid


def test_an_oom_region_is_not_probed_past_its_boundary() -> None:
    hist = _tune(_separable, _oom_region)
    ooms = [c.point for c, o in hist if o.status == "oom"]
    for i, p in enumerate(ooms):  # no OOM probed where an earlier OOM already said it cannot fit
        assert not any(needs_more_memory(p, q) for q in ooms[:i]), (p.name, [q.name for q in ooms[:i]])
    walk = [c.point for c, _ in hist[:3]]  # the start walks down one class of settings, not across classes
    assert [(p.stage, p.micro_batch) for p in walk] == [(1, 16), (1, 8), (1, 4)]
    assert len({p.memory_class() for p in walk}) == 1


def test_oom_rules_out_larger_buckets_not_other_precisions_or_higher_stages() -> None:
    points = _points()
    oom = _at(points, 2, 4, 1024, "fp32")
    pruned = {
        (p.stage, p.micro_batch, p.bucket_bytes, p.precision)
        for p in pruned_by_oom(points, [(Candidate(oom, 3), Outcome("oom"))])
    }
    expected = {(s, m, b, "fp32") for s in (1, 2) for m in (4, 8, 16) for b in (1024, 4096)} - {(2, 4, 1024, "fp32")}
    assert pruned == expected
    assert not needs_more_memory(_at(points, 2, 4, 4096, "fp32"), _at(points, 2, 4, 1024, "bf16"))


def _first(points: list[Point], values: dict[tuple, float | None]) -> dict[Point, Outcome]:
    """Round-0 outcomes by ``(stage, micro, bucket, precision)``; ``None`` is an OOM."""
    return {_at(points, *k): Outcome("oom") if v is None else _ok(v) for k, v in values.items()}


def _descend(points: list[Point], first: dict[Point, Outcome]) -> list[Point]:
    hist = [(Candidate(p, 9), o) for p, o in first.items()]
    live = [p for p in points if p not in pruned_by_oom(points, hist)]
    return descend(points, live, first, THR, None, 0.01)


def _key(p: Point) -> tuple:
    return (p.stage, p.micro_batch, p.bucket_bytes, p.precision)


def test_moves_at_the_first_better_neighbour_then_continues_that_way() -> None:
    points = _points()
    first = _first(points, {(1, 16, 1024, "bf16"): None, (1, 8, 1024, "bf16"): None, (1, 4, 1024, "bf16"): 1.0})
    start = _descend(points, first)  # the plane first, the settings last
    assert [_key(p) for p in start] == [
        (1, 2, 1024, "bf16"),
        (2, 4, 1024, "bf16"),
        (2, 8, 1024, "bf16"),
        (1, 4, 1024, "fp32"),
        (1, 4, 4096, "bf16"),
    ]
    first[_at(points, 2, 8)] = _ok(2.0)  # the diagonal is better: move now, the rest of z1 mb4's neighbours unmeasured
    moved = _descend(points, first)
    assert _key(moved[0]) == (3, 16, 1024, "bf16")  # one more step the same way first
    assert _at(points, 1, 2) not in moved and _at(points, 2, 4) in moved  # z2 mb4 is z2 mb8's neighbour too


def test_a_setting_that_does_not_interact_is_not_probed_after_a_move() -> None:
    points = _points()
    # bf16 beat fp32 at two points of the rest of the space; the search then moved to z2 mb8
    values = {(1, 8, 1024, "bf16"): None, (1, 4, 1024, "bf16"): 1.0, (1, 4, 1024, "fp32"): 0.8}
    values |= {(1, 2, 1024, "bf16"): 0.9, (1, 2, 1024, "fp32"): 0.7, (2, 8, 1024, "bf16"): 2.0}
    first = _first(points, {(1, 16, 1024, "bf16"): None, **values})
    measured = {p: m for p, o in first.items() if (m := o.measurement(THR)) is not None}
    assert screened(points, measured, THR, 0.01) == frozenset({"precision"})  # the bucket was never compared
    proposed = {_key(p) for p in _descend(points, first)}
    assert (2, 8, 1024, "fp32") not in proposed and (2, 8, 4096, "bf16") in proposed


def test_a_setting_whose_comparisons_contradict_is_probed_at_every_point() -> None:
    points = _points()
    values = {(1, 8, 1024, "bf16"): None, (1, 4, 1024, "bf16"): 1.0, (1, 4, 1024, "fp32"): 0.8}
    values |= {(1, 2, 1024, "bf16"): 0.7, (1, 2, 1024, "fp32"): 0.9, (2, 8, 1024, "bf16"): 2.0}  # fp32 wins here
    first = _first(points, {(1, 16, 1024, "bf16"): None, **values})
    measured = {p: m for p, o in first.items() if (m := o.measurement(THR)) is not None}
    assert screened(points, measured, THR, 0.01) == frozenset()
    assert (2, 8, 1024, "fp32") in {_key(p) for p in _descend(points, first)}


def test_ties_agree_with_anything() -> None:
    points = _points()
    a, b = _at(points, 1, 4, 1024, "bf16"), _at(points, 1, 4, 1024, "fp32")
    c, d = _at(points, 2, 4, 1024, "bf16"), _at(points, 2, 4, 1024, "fp32")
    tied = {p: m for p, v in ((a, 1.0), (b, 1.005), (c, 2.0), (d, 1.0)) if (m := _ok(v).measurement(THR))}
    assert "precision" in screened(points, tied, THR, 0.01)  # 0.5 % is within the noise floor: no contradiction


@pytest.mark.parametrize(("min_steps", "measure", "rungs"), [(3, 10, [3, 10]), (3, 9, [3, 9]), (2, 18, [2, 6, 18])])
def test_halving_skips_a_round_that_would_leave_less_than_eta(min_steps: int, measure: int, rungs: list[int]) -> None:
    spec = parse_tuning({"space": {"micro_batch": [1, 2]}, "min_steps": min_steps, "measure_steps": measure}, "x")
    tuner = ModelBasedTuner(spec)
    got = [tuner.rung_steps(r) for r in range(len(rungs))]
    assert got == rungs and tuner.rung_steps(len(rungs)) == measure


def test_halving_only_where_cutting_to_one_in_eta_pays() -> None:
    space = {"micro_batch": [1, 2]}
    spec = parse_tuning({"space": space, **WINDOW}, "x")
    p, q = _points(space)
    fixed, per_step = 10.0, 1.0  # 9 measured steps cost 21 s, 3 cost 15 s: 1.4x
    runs = [(p, 9, fixed + per_step * 11), (q, 3, fixed + per_step * 5)]  # 2 warm-up steps each
    hist = [(Candidate(x, n), _ok(1.0, n, sec, latency=per_step)) for x, n, sec in runs]
    ratio = (fixed + per_step * 11) / (fixed + per_step * 5)
    assert default_one_round_ratio(spec.eta) == spec.eta / (spec.eta - 1)
    # halving 3 x 15 s + 1 x 21 s = 66 s > 3 x 21 s = 63 s for three points: one round
    assert ratio < default_one_round_ratio(spec.eta) and ModelBasedTuner(spec).one_round(hist) is True
    assert ModelBasedTuner(spec, one_round_ratio=ratio * 0.9).one_round(hist) is False


def test_an_improvement_within_the_noise_moves_only_once_the_neighbourhood_is_measured() -> None:
    points = _points()
    first = _first(points, {(1, 16, 1024, "bf16"): None, (1, 8, 1024, "bf16"): None, (1, 4, 1024, "bf16"): 1.0})
    first |= _first(points, {(1, 2, 1024, "bf16"): 1.005})  # better by 0.5 %, under the 1 % noise floor
    rest = _descend(points, first)
    assert _at(points, 2, 4) in rest and _at(points, 1, 1) not in rest  # still z1 mb4's neighbourhood
    first |= {p: _ok(0.5) for p in rest}  # the rest is worse: now the small improvement is the best there is
    assert _at(points, 1, 1) in _descend(points, first)
