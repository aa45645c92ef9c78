"""Tuners: pure functions from the results so far to the experiments still wanted.

Each tuner's :meth:`propose` gets the space's points and the finished :class:`Candidate` → :class:`Outcome` pairs
(in finishing order) and returns the candidates it still wants, in priority order; an empty list means it is done.
The loop asks again after every finished experiment, so a queued candidate the tuner no longer wants (pruned by an
OOM) is dropped before it starts, and a restarted tuner recomputes the same proposals from the journal.

* :class:`GridTuner` — every point, in order (``max_trials`` keeps the first N).
* :class:`RandomTuner` — a seeded random sample of ``max_trials`` points (default a quarter of the space).
* :class:`ModelBasedTuner` — memory-model pruning, then successive halving on measured steps:

  1. round 0 measures every point for ``min_steps`` steps, highest stage first and smallest micro batch first;
     an OOM at (stage s, micro batch m) rules out every point of the same other settings with a micro batch
     ≥ m at a stage ≤ s (a larger batch needs more memory; what fits at stage s fits at s+1, so what does not
     fit at s does not fit below it either);
  2. each later round keeps the best 1/eta of the previous round — plus every point the noise-aware comparison
     cannot tell apart from the last one kept — and measures them ``eta`` times longer, up to ``measure_steps``;
  3. it stops when one point is left or the full ``measure_steps`` round is done.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from elasticzero.autotune.metrics import Measurement, Metric, clearly_better
from elasticzero.autotune.outcome import Outcome
from elasticzero.autotune.space import Point, TuningSpec

__all__ = ["Candidate", "GridTuner", "ModelBasedTuner", "RandomTuner", "best", "make_tuner", "pruned_by_oom", "stalled"]

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


class ModelBasedTuner:
    def __init__(self, spec: TuningSpec) -> None:
        self.spec = spec

    def rung_steps(self, rung: int) -> int:
        return min(self.spec.measure_steps, self.spec.min_steps * self.spec.eta**rung)

    def propose(self, points: Sequence[Point], history: History) -> list[Candidate]:
        pruned = pruned_by_oom(points, history)
        order = sorted((p for p in points if p not in pruned), key=_probe_order)
        if self.spec.max_trials:
            order = order[: self.spec.max_trials]
        alive = order
        rung = 0
        while True:
            cands = [Candidate(p, self.rung_steps(rung), rung) for p in alive]
            missing = _missing(cands, history)
            if missing:
                return missing
            if self.rung_steps(rung) >= self.spec.measure_steps:
                return []
            alive = self._survivors(cands, history)
            if len(alive) <= 1:  # a clear winner: measuring it longer would not change the choice
                return []
            rung += 1

    def _survivors(self, cands: list[Candidate], history: History) -> list[Point]:
        results = dict(history)
        metric = self.spec.metric
        measured = [(c.point, m) for c in cands if (m := results[c].measurement(metric)) is not None]
        measured.sort(key=lambda pm: metric.sort_key(pm[1].value))
        if not measured:
            return []
        keep = max(1, math.ceil(len(measured) / self.spec.eta))
        last = measured[keep - 1][1]
        tied = [p for p, m in measured[keep:] if not clearly_better(metric, last, m, rel_floor=self.spec.noise)]
        return [p for p, _ in measured[:keep]] + tied


def _probe_order(p: Point) -> tuple[object, ...]:
    """Round 0's order: per memory class, highest stage first, then the smallest micro batch (OOMs prune most)."""
    return (tuple(str(v) for v in p.memory_class()), -p.stage, p.micro_batch)


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
    return {"grid": GridTuner, "random": RandomTuner, "model_based": ModelBasedTuner}[spec.tuner](spec)
