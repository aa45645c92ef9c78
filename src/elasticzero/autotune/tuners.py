"""Tuners: pure functions from the results so far to the experiments still wanted.

Each tuner's :meth:`propose` gets the space's points and the finished :class:`Candidate` → :class:`Outcome` pairs
(in finishing order) and returns the candidates it still wants, in priority order; an empty list means it is done.
The loop asks again after every finished experiment, so a queued candidate the tuner no longer wants (pruned by an
OOM) is dropped before it starts, and a restarted tuner recomputes the same proposals from the journal.

* :class:`GridTuner` — every point, in order (``max_trials`` keeps the first N).
* :class:`RandomTuner` — a seeded random sample of ``max_trials`` points (default a quarter of the space).
* :class:`ModelBasedTuner` — memory-model pruning, a local search, then successive halving — or one round when
  an experiment's fixed cost dominates its steps:

  1. an OOM at (stage s, micro batch m, bucket b) rules out every point of the same other settings with a micro
     batch ≥ m at a stage ≤ s with a bucket ≥ b (a larger batch or bucket needs more memory; what fits at stage s
     fits at s+1, so what does not fit at s does not fit below it);
  2. round 0 (``min_steps`` steps each, or ``measure_steps``: see below) is a local search (:mod:`.search`): from
     the lowest stage with the largest micro batch the memory model allows, it measures the neighbours of the
     current point in priority order and moves as soon as one is clearly better, until the point is a local
     optimum;
     settings found not to interact are not probed again after a move;
  3. successive halving on round 0's results: each round keeps the best 1/eta — plus every point the noise-aware
     comparison cannot tell apart from the last one kept — and measures them ``eta`` times longer, up to
     ``measure_steps`` (a round that would leave less than a factor ``eta`` to ``measure_steps`` goes straight to
     it); it stops when one point is left or the full ``measure_steps`` round is done. A point already measured at
     least a round's steps is not measured again.

Cost-aware (:func:`estimate_cost`, :meth:`ModelBasedTuner.one_round`): from the experiments so far the tuner
estimates an experiment's fixed cost (launch, imports, model build, warm-up) and its cost per step. Halving pays only
when cutting round 0 to 1/eta saves more than round 0 costs: when measuring ``measure_steps`` costs less than
``eta/(eta-1)`` (1.5 for eta 3) times measuring ``min_steps`` (:func:`default_one_round_ratio`), re-launching
survivors for longer measurements buys nothing: round 0 measures ``measure_steps`` and halving jumps straight to
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
from elasticzero.autotune.search import descend
from elasticzero.autotune.space import Point, TuningSpec

__all__ = [
    "Candidate",
    "CostModel",
    "GridTuner",
    "ModelBasedTuner",
    "RandomTuner",
    "best",
    "default_one_round_ratio",
    "descend",
    "estimate_cost",
    "make_tuner",
    "needs_more_memory",
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


def default_one_round_ratio(eta: int) -> float:
    """Halving pays when cutting to 1/eta saves more than round 0 costs: N x cost(min) + N/eta x cost(measure) <
    N x cost(measure), i.e. cost(measure) > eta/(eta-1) x cost(min); below that ratio, one round (1.5 for eta 3)."""
    return eta / (eta - 1)


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
    def __init__(self, spec: TuningSpec, one_round_ratio: float | None = None) -> None:
        self.spec = spec
        self.one_round_ratio = default_one_round_ratio(spec.eta) if one_round_ratio is None else one_round_ratio

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
        steps = self.spec.min_steps * self.spec.eta**rung
        if rung and steps * self.spec.eta > self.spec.measure_steps:  # the next round would be cut short: go there
            return self.spec.measure_steps
        return min(self.spec.measure_steps, steps)

    def propose(self, points: Sequence[Point], history: History) -> list[Candidate]:
        pruned = pruned_by_oom(points, history)
        live = [p for p in points if p not in pruned]
        first = {c.point: o for c, o in history if c.rung == 0}
        probe = descend(points, live, first, self.spec.metric, self.spec.max_trials, self.spec.noise)
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


def _missing(cands: list[Candidate], history: History) -> list[Candidate]:
    done = {c for c, _ in history}
    return [c for c in cands if c not in done]


def pruned_by_oom(points: Sequence[Point], history: History) -> dict[Point, Point]:
    """Points ruled out by an OOM (point → the OOM that rules it out), by the memory model in the module docstring."""
    ooms = [c.point for c, o in history if o.status == "oom"]
    out: dict[Point, Point] = {}
    for p in points:
        q = next((q for q in ooms if p != q and needs_more_memory(p, q)), None)
        if q is not None:
            out[p] = q
    return out


def needs_more_memory(p: Point, q: Point) -> bool:
    """Whether ``p`` needs at least ``q``'s memory: a micro batch ≥ q's at a stage ≤ q's with a bucket ≥ q's (the
    buckets are allocated buffers), every other setting equal."""
    rest = (p.precision, p.prefetch, p.reshard_after_forward) == (q.precision, q.prefetch, q.reshard_after_forward)
    bucket = p.bucket_bytes == q.bucket_bytes or (
        p.bucket_bytes is not None and q.bucket_bytes is not None and p.bucket_bytes >= q.bucket_bytes
    )
    return rest and bucket and p.stage <= q.stage and p.micro_batch >= q.micro_batch


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
