"""Tuners: pure functions from the results so far to the experiments still wanted.

Each tuner's :meth:`propose` gets the space's points and the finished :class:`Candidate` → :class:`Outcome` pairs
(in finishing order) and returns the candidates it still wants, in priority order; an empty list means it is done.
The loop asks again after every finished experiment, so a queued candidate the tuner no longer wants (pruned by an
OOM) is dropped before it starts, and a restarted tuner recomputes the same proposals from the journal.

* :class:`GridTuner` — every point, in order (``max_trials`` keeps the first N).
* :class:`RandomTuner` — a seeded random sample of ``max_trials`` points (default a quarter of the space).
* :class:`ModelBasedTuner` — memory-model pruning, a local search, then successive halving — or one round when
  an experiment's fixed cost dominates its steps:

  1. an OOM at (stage s, micro batch m) rules out every point of the same other settings with a micro batch
     ≥ m at a stage ≤ s (a larger batch needs more memory; what fits at stage s fits at s+1, so what does not
     fit at s does not fit below it);
  2. round 0 (``min_steps`` steps each, or ``measure_steps``: see below) is a local search (:func:`descend`): from
     the lowest stage with the largest micro batch the memory model allows, it measures the unmeasured neighbours
     of the best point so far until that point is a local optimum;
  3. successive halving on round 0's results: each round keeps the best 1/eta — plus every point the noise-aware
     comparison cannot tell apart from the last one kept — and measures them ``eta`` times longer, up to
     ``measure_steps``; it stops when one point is left or the full ``measure_steps`` round is done. A point already
     measured at least a round's steps is not measured again.

Cost-aware (:func:`estimate_cost`, :meth:`ModelBasedTuner.one_round`): from the experiments so far the tuner
estimates an experiment's fixed cost (launch, imports, model build, warm-up) and its cost per step. When measuring
``measure_steps`` costs less than ``one_round_ratio`` (1.25) times measuring ``min_steps``, re-launching survivors
for longer measurements buys nothing: round 0 measures ``measure_steps`` and halving jumps straight to
``measure_steps``: nothing is measured twice. Until a first success tells the cost, probes measure
``measure_steps`` (in the fixed-cost regime that is their only measurement; in the step regime it is one longer
experiment, kept). A round's cut uses each point's measurements up to that round; a clear winner that lacks the
longest measurement any point has gets it (the choice is made among equally long measurements).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from elasticzero.autotune.metrics import Measurement, Metric, clearly_better
from elasticzero.autotune.outcome import Outcome
from elasticzero.autotune.space import Point, TuningSpec

__all__ = [
    "Candidate",
    "CostModel",
    "GridTuner",
    "ModelBasedTuner",
    "RandomTuner",
    "best",
    "descend",
    "estimate_cost",
    "make_tuner",
    "pruned_by_oom",
    "stalled",
]

History = Sequence[tuple["Candidate", Outcome]]


@dataclass(frozen=True)
class Candidate:
    """A point measured for ``steps`` steps in round ``rung``."""

    point: Point
    steps: int
    rung: int = 0


class GridTuner:
    def __init__(self, spec: TuningSpec) -> None:
        self.spec = spec

    def propose(self, points: Sequence[Point], history: History) -> list[Candidate]:
        chosen = list(points)[: self.spec.max_trials] if self.spec.max_trials else list(points)
        return _missing([Candidate(p, self.spec.measure_steps) for p in chosen], history)


class RandomTuner:
    def __init__(self, spec: TuningSpec) -> None:
        self.spec = spec

    def propose(self, points: Sequence[Point], history: History) -> list[Candidate]:
        order = list(points)
        random.Random(self.spec.seed).shuffle(order)
        n = self.spec.max_trials or max(1, math.ceil(len(order) / 4))
        return _missing([Candidate(p, self.spec.measure_steps) for p in order[:n]], history)


#: measuring ``measure_steps`` costing less than this many times ``min_steps``: one round (see the module docstring)
ONE_ROUND_RATIO = 1.25


@dataclass(frozen=True)
class CostModel:
    """An experiment's seconds: ``fixed`` (launch, imports, model build, warm-up overhead) + ``per_step`` a step."""

    fixed: float
    per_step: float

    def seconds(self, steps: int) -> float:
        return self.fixed + self.per_step * steps


def estimate_cost(history: History, warmup_steps: int) -> CostModel | None:
    """The cost model from the successful experiments' seconds and steps (``None``: not known yet).

    The cost per step is the median reported ``latency`` (s/step) when trials report it, else the least-squares slope
    of seconds over steps run (needs two step counts); the fixed cost is the median of what each experiment's
    steps (warm-up included) leave of its seconds.
    """
    runs = [(warmup_steps + c.steps, o) for c, o in history if o.ok and o.seconds > 0]
    if not runs:
        return None
    latencies = [v for _, o in runs if (m := Measurement.from_metrics(o.metrics, "latency")) and (v := m.value) >= 0]
    if latencies:
        per_step = statistics.median(latencies)
    elif len({n for n, _ in runs}) >= 2:
        slope = statistics.linear_regression([float(n) for n, _ in runs], [o.seconds for _, o in runs]).slope
        per_step = max(0.0, slope)
    else:
        return None
    return CostModel(statistics.median(max(0.0, o.seconds - n * per_step) for n, o in runs), per_step)


class ModelBasedTuner:
    def __init__(self, spec: TuningSpec, one_round_ratio: float = ONE_ROUND_RATIO) -> None:
        self.spec = spec
        self.one_round_ratio = one_round_ratio

    def one_round(self, history: History) -> bool | None:
        """Whether the fixed cost dominates: ``measure_steps`` cost < ratio x ``min_steps`` (``None``: unknown)."""
        cost = estimate_cost(history, self.spec.warmup_steps)
        if cost is None:
            return None
        w = self.spec.warmup_steps
        return cost.seconds(w + self.spec.measure_steps) < self.one_round_ratio * cost.seconds(w + self.spec.min_steps)

    def probe_steps(self, history: History) -> int:
        """Round 0's steps: ``measure_steps`` in one-round mode and until a first success tells the cost."""
        one = self.one_round(history)
        full = one if one is not None else not any(o.ok for _, o in history)
        return self.spec.measure_steps if full else min(self.spec.min_steps, self.spec.measure_steps)

    def rung_steps(self, rung: int, one_round: bool = False) -> int:
        if one_round:
            return self.spec.measure_steps if rung else min(self.spec.min_steps, self.spec.measure_steps)
        return min(self.spec.measure_steps, self.spec.min_steps * self.spec.eta**rung)

    def propose(self, points: Sequence[Point], history: History) -> list[Candidate]:
        pruned = pruned_by_oom(points, history)
        live = [p for p in points if p not in pruned]
        first = {c.point: o for c, o in history if c.rung == 0}
        probe = descend(points, live, first, self.spec.metric, self.spec.max_trials)
        if probe:
            steps = self.probe_steps(history)
            return [Candidate(p, steps, 0) for p in probe]
        alive = [p for p in live if p in first and first[p].ok]
        return self._halve(alive, history, bool(self.one_round(history)))

    def _halve(self, alive: list[Point], history: History, one_round: bool) -> list[Candidate]:
        """Successive halving over round 0's points (see the module docstring); the experiments still wanted."""
        top = max((c.steps for c, o in history if o.ok), default=0)  # best() chooses among the longest
        rung = 0
        while True:
            need = self.rung_steps(rung, one_round)
            seen = _longest(history, rung)
            missing = [Candidate(p, need, rung) for p in alive if seen[p][0] < need]
            if missing:
                return missing
            if need >= self.spec.measure_steps:
                return []
            alive = self._survivors(alive, seen)
            if len(alive) <= 1:  # a clear winner: only measured as long as the longest, for best() to compare
                final = _longest(history, None)
                return [Candidate(p, top, rung + 1) for p in alive if final[p][0] < top]
            rung += 1

    def _survivors(self, alive: list[Point], longest: dict[Point, tuple[int, Outcome]]) -> list[Point]:
        metric = self.spec.metric
        measured = [(p, m) for p in alive if (m := longest[p][1].measurement(metric)) is not None]
        measured.sort(key=lambda pm: metric.sort_key(pm[1].value))
        if not measured:
            return []
        keep = max(1, math.ceil(len(measured) / self.spec.eta))
        last = measured[keep - 1][1]
        tied = [p for p, m in measured[keep:] if not clearly_better(metric, last, m, rel_floor=self.spec.noise)]
        return [p for p, _ in measured[:keep]] + tied


def _longest(history: History, rung: int | None) -> dict[Point, tuple[int, Outcome]]:
    """Each point's longest measurement (the latest of equals) in rounds up to ``rung`` (every round: ``None``)."""
    out: dict[Point, tuple[int, Outcome]] = {}
    for c, o in history:
        if (rung is None or c.rung <= rung) and c.steps >= out.get(c.point, (0, o))[0]:
            out[c.point] = (c.steps, o)
    return out


def _prior(p: Point) -> tuple[object, ...]:
    """Where the descent starts: the lowest stage (least communication) with the largest micro batch."""
    return (p.stage, -p.micro_batch, tuple(str(v) for v in p.memory_class()))


def descend(
    points: Sequence[Point],
    live: Sequence[Point],
    first: dict[Point, Outcome],
    metric: Metric,
    limit: int | None,
) -> list[Point]:
    """Round 0's next probes: a best-improvement local search on the space.

    Neighbours differ in one setting — the adjacent micro batch or stage, any other value of the remaining settings
    — or go one stage up *and* one micro batch up (a higher stage frees the memory a larger batch needs). Before any
    success the start is the lowest stage with the largest micro batch the memory model still allows; from the
    first success on, the whole neighbourhood of the current point is measured, then the search moves to the best
    of it (replayed from the results, so the path is the same after a restart). An empty list: a local optimum
    (or ``limit`` probes were made), and successive halving takes over.
    """
    if limit is not None and len(first) >= limit:
        return []
    live_set = set(live)

    def value(p: Point) -> float | None:
        m = first[p].measurement(metric) if p in first else None
        return None if m is None else metric.sort_key(m.value)

    incumbent = next((p for p in sorted(first, key=_prior) if value(p) is not None), None)
    if incumbent is None:  # nothing succeeded yet: walk down from the prior's favourite
        start = next((p for p in sorted(live, key=_prior) if p not in first), None)
        return [start] if start is not None else []
    while True:  # best improvement: a whole neighbourhood is measured before the search moves
        near = [p for p in _neighbours(incumbent, points) if p in live_set]
        todo = [p for p in near if p not in first]
        if todo:
            return todo[: None if limit is None else limit - len(first)]
        scored = [(v, p) for p in [incumbent, *near] if (v := value(p)) is not None]
        nxt = min(scored, key=lambda vp: vp[0])[1]
        if nxt == incumbent:
            return []
        incumbent = nxt


def _neighbours(q: Point, points: Sequence[Point]) -> list[Point]:
    """``q``'s neighbours (see :func:`descend`), micro-batch steps first, then stage steps, diagonal, the rest."""
    stages = sorted({p.stage for p in points})
    micros = sorted({p.micro_batch for p in points})
    ranked: list[tuple[int, Point]] = []
    for p in points:
        rank = _neighbour_rank(q, p, stages, micros)
        if rank is not None:
            ranked.append((rank, p))
    return [p for _, p in sorted(ranked, key=lambda rp: (rp[0], _prior(rp[1])))]


def _neighbour_rank(q: Point, p: Point, stages: list[int], micros: list[int]) -> int | None:
    def at(levels: list[int], value: int, by: int) -> int | None:
        i = levels.index(value) + by
        return levels[i] if 0 <= i < len(levels) else None

    same_rest = (p.bucket_bytes, p.precision) == (q.bucket_bytes, q.precision) and (
        (p.stage == 3) != (q.stage == 3)
        or (p.prefetch, p.reshard_after_forward) == (q.prefetch, q.reshard_after_forward)
    )
    if (p.stage, p.micro_batch) == (q.stage, q.micro_batch):
        return 3 if sum(a != b for a, b in zip(p.memory_class(), q.memory_class(), strict=True)) == 1 else None
    if not same_rest:
        return None
    if p.stage == q.stage and p.micro_batch in (at(micros, q.micro_batch, -1), at(micros, q.micro_batch, 1)):
        return 0
    if p.micro_batch == q.micro_batch and p.stage in (at(stages, q.stage, -1), at(stages, q.stage, 1)):
        return 1
    if p.stage == at(stages, q.stage, 1) and p.micro_batch == at(micros, q.micro_batch, 1):
        return 2
    return None


def _missing(cands: list[Candidate], history: History) -> list[Candidate]:
    done = {c for c, _ in history}
    return [c for c in cands if c not in done]


def pruned_by_oom(points: Sequence[Point], history: History) -> dict[Point, Point]:
    """Points ruled out by an OOM (point → the OOM that rules it out), by the memory model in the module docstring."""
    ooms = [c.point for c, o in history if o.status == "oom"]
    out: dict[Point, Point] = {}
    for p in points:
        for q in ooms:
            same = p.memory_class() == q.memory_class()
            if same and p.stage <= q.stage and p.micro_batch >= q.micro_batch and p != q:
                out[p] = q
                break
    return out


def stalled(history: History, metric: Metric, patience: int | None, noise: float) -> bool:
    """Early stopping: the last ``patience`` finished experiments brought no clear improvement of the best."""
    if not patience or len(history) <= patience:
        return False
    best_m: Measurement | None = None
    since = 0
    for _, outcome in history:
        m = outcome.measurement(metric)
        if m is not None and (best_m is None or clearly_better(metric, m, best_m, rel_floor=noise)):
            best_m, since = m, 0
        else:
            since += 1
    return best_m is not None and since >= patience


def best(history: History, metric: Metric) -> tuple[Candidate, Outcome] | None:
    """The best successful experiment among those measured longest (later rounds beat their own earlier figures)."""
    ok = [(c, o) for c, o in history if o.measurement(metric) is not None]
    if not ok:
        return None
    longest = max(c.steps for c, _ in ok)
    top = [(c, o) for c, o in ok if c.steps == longest]
    return min(top, key=lambda co: metric.sort_key(co[1].metrics[metric.name]))


def make_tuner(spec: TuningSpec) -> GridTuner | RandomTuner | ModelBasedTuner:
    if spec.tuner == "grid":
        return GridTuner(spec)
    return RandomTuner(spec) if spec.tuner == "random" else ModelBasedTuner(spec)
