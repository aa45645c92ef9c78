"""Round 0 of the model-based tuner: a local search, a pure function of the measurements so far.

The space has two kinds of dimensions. Stage and micro batch interact strongly (memory, traffic per micro-batch):
they are searched as a plane — the adjacent micro batch, the adjacent stage, and one stage up with the next larger
micro batch (a higher stage frees the memory a larger batch needs). The settings (bucket size, precision, stage-3
prefetch and reshard) are searched by trying their other values at the current point.

What keeps it cheap on larger spaces:

* the start: the lowest stage with the largest micro batch the memory model allows, walking the micro batches down
  past OOMs in one class of settings (the prior's first) — not the same OOM in every class; the search starts from
  the first success;
* first improvement: the unmeasured neighbours are proposed in priority order — the direction of the last move
  first, then the plane, then the settings still open — and the search moves to the best measured neighbour as soon
  as one is clearly better than the current point (beyond the noise, :func:`~.metrics.clearly_better`); a smaller
  improvement moves it once the whole neighbourhood is measured. On a one-experiment pool that is after the first
  clearly better one; when the pool runs the neighbours side by side, the best of those measured;
* screening: a setting that was compared at two points of the rest of the space without contradiction (no value
  clearly beat another at one point and clearly lost to it at the other; ties agree with anything) does not interact
  with where the search is: it is not probed again after a move, and the search keeps the value it carries. A
  setting whose comparisons contradict each other is probed at every point the search reaches.

The path is replayed from the measurements, so a restarted tuner proposes the same experiments; screening only
withholds new probes, never a move to a point already measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from elasticzero.autotune.metrics import Measurement, Metric, clearly_better
from elasticzero.autotune.outcome import Outcome
from elasticzero.autotune.space import Point

__all__ = ["SETTINGS", "descend", "neighbours", "screened"]

#: the dimensions searched by trying their other values (every dimension but stage and micro batch)
SETTINGS = ("bucket_bytes", "precision", "prefetch", "reshard_after_forward")
#: a neighbour's rank (see :func:`_rank`) when it differs in one setting
SETTING = 3


def prior(p: Point) -> tuple[object, ...]:
    """Where the search starts: the lowest stage (least communication) with the largest micro batch."""
    return (p.stage, -p.micro_batch, tuple(str(v) for v in p.memory_class()))


def descend(
    points: Sequence[Point],
    live: Sequence[Point],
    first: Mapping[Point, Outcome],
    metric: Metric,
    limit: int | None,
    noise: float = 0.01,
) -> list[Point]:
    """Round 0's next probes in priority order (see the module docstring); empty: a local optimum (or ``limit``
    probes were made) — successive halving takes over."""
    if limit is not None and len(first) >= limit:
        return []
    measured = {p: m for p, o in first.items() if (m := o.measurement(metric)) is not None}
    if not measured:  # nothing succeeded yet: walk down from the prior's favourite
        return [p for p in start_order(points, live, first) if p not in first][:1]
    incumbent = next(p for p in first if p in measured)  # the first success: where the walk ended
    usable = {p for p in live if p not in first or p in measured}  # not ruled out, not failed
    skip = screened(points, measured, metric, noise)
    previous, incumbent = climb(incumbent, points, usable, measured, metric, noise, skip)
    todo = [p for p in neighbours(incumbent, points, usable, previous, skip) if p not in first]
    return todo[: None if limit is None else limit - len(first)]


def start_order(points: Sequence[Point], live: Sequence[Point], first: Mapping[Point, Outcome]) -> list[Point]:
    """``live`` in the start walk's order: the prior's first class of settings by the prior, then the rest; a class
    where an experiment failed for another reason than memory goes last (an OOM says walk down, an error does not)."""
    top = min(points, key=prior).memory_class()
    broken = {p.memory_class() for p, o in first.items() if o.status not in ("ok", "oom")}
    return sorted(live, key=lambda p: (p.memory_class() in broken, p.memory_class() != top, prior(p)))


def climb(
    start: Point,
    points: Sequence[Point],
    usable: set[Point],
    measured: Mapping[Point, Measurement],
    metric: Metric,
    noise: float,
    skip: frozenset[str],
) -> tuple[Point | None, Point]:
    """``(the point before, the current point)``: from ``start``, moves to the best measured neighbour while it is
    clearly better than the current point (beyond the noise), or better at all once every neighbour the search
    would probe is measured (each move improves, so the walk ends)."""
    key = {p: metric.sort_key(m.value) for p, m in measured.items()}
    previous, current = None, start
    while True:
        near = neighbours(current, points, usable)
        better = sorted((p for p in near if p in key and key[p] < key[current]), key=key.__getitem__)
        complete = all(p in key for p in neighbours(current, points, usable, skip=skip))
        if not better or not (
            complete or clearly_better(metric, measured[better[0]], measured[current], rel_floor=noise)
        ):
            return previous, current
        previous, current = current, better[0]


def neighbours(
    q: Point,
    points: Sequence[Point],
    usable: set[Point],
    previous: Point | None = None,
    skip: frozenset[str] = frozenset(),
) -> list[Point]:
    """``q``'s usable neighbours (see the module docstring) in priority order: the continuation of the move
    ``previous`` → ``q``, then micro-batch steps, stage steps, the diagonal, the settings but those in ``skip`` (the
    prior breaks ties)."""
    stages = sorted({p.stage for p in points})
    micros = sorted({p.micro_batch for p in points})
    ahead = _ahead(previous, q, stages, micros)
    ranked = []
    for p in points:
        rank = _rank(q, p, stages, micros)
        if rank is not None and p in usable and _differs_in(q, p) not in skip:
            ranked.append((0 if (p.stage, p.micro_batch) == ahead else 1, rank, prior(p), p))
    return [p for *_, p in sorted(ranked, key=lambda t: t[:3])]


def _rank(q: Point, p: Point, stages: list[int], micros: list[int]) -> int | None:
    """0: the adjacent micro batch; 1: the adjacent stage; 2: one stage and one micro batch up; 3: another value of
    one setting; ``None``: not a neighbour."""
    if (p.stage, p.micro_batch) == (q.stage, q.micro_batch):
        return SETTING if _differs_in(q, p) is not None else None
    if not _same_settings(p, q):
        return None
    ds = _step(stages, q.stage, p.stage)
    dm = _step(micros, q.micro_batch, p.micro_batch)
    return {(0, 1): 0, (0, -1): 0, (1, 0): 1, (-1, 0): 1, (1, 1): 2}.get((ds, dm))


def _step(levels: list[int], a: int, b: int) -> int:
    return levels.index(b) - levels.index(a)


def _same_settings(p: Point, q: Point) -> bool:
    """Equal settings; the stage-3-only ones count only when both points are at stage 3."""
    if (p.bucket_bytes, p.precision) != (q.bucket_bytes, q.precision):
        return False
    return (p.stage == 3) != (q.stage == 3) or (p.prefetch, p.reshard_after_forward) == (
        q.prefetch,
        q.reshard_after_forward,
    )


def _differs_in(q: Point, p: Point) -> str | None:
    """The one setting in which ``p`` differs from ``q`` at the same stage and micro batch (``None``: not one)."""
    if (p.stage, p.micro_batch) != (q.stage, q.micro_batch):
        return None
    diff = [d for d in SETTINGS if getattr(p, d) != getattr(q, d)]
    return diff[0] if len(diff) == 1 else None


def _ahead(previous: Point | None, q: Point, stages: list[int], micros: list[int]) -> tuple[int, int] | None:
    """(stage, micro batch) one more step in the direction ``previous`` → ``q`` took in the plane (``None``: none)."""
    if previous is None or not _same_settings(previous, q):
        return None
    s = stages.index(q.stage) + _step(stages, previous.stage, q.stage)
    m = micros.index(q.micro_batch) + _step(micros, previous.micro_batch, q.micro_batch)
    if not (0 <= s < len(stages) and 0 <= m < len(micros)):
        return None
    return (stages[s], micros[m])


def screened(
    points: Sequence[Point], measured: Mapping[Point, Measurement], metric: Metric, noise: float
) -> frozenset[str]:
    """The settings found not to interact (see the module docstring): compared at two or more points of the rest of
    the space, and no comparison contradicts another."""
    varying = [d for d in SETTINGS if len({getattr(p, d) for p in points}) > 1]
    return frozenset(d for d in varying if _agrees(_comparisons(d, measured), metric, noise))


def _comparisons(dim: str, measured: Mapping[Point, Measurement]) -> list[dict[object, Measurement]]:
    """Per point of the rest of the space (``dim`` left out) with two or more of its values measured: those values."""
    groups: dict[tuple[object, ...], dict[object, Measurement]] = {}
    for p, m in measured.items():
        rest = tuple(getattr(p, f.name) for f in dataclasses.fields(p) if f.name != dim)
        groups.setdefault(rest, {})[getattr(p, dim)] = m
    return [g for g in groups.values() if len(g) > 1]


def _agrees(groups: list[dict[object, Measurement]], metric: Metric, noise: float) -> bool:
    if len(groups) < 2:
        return False
    wins = {
        (a, b)
        for g in groups
        for a, ma in g.items()
        for b, mb in g.items()
        if clearly_better(metric, ma, mb, rel_floor=noise)
    }
    return not any((b, a) in wins for a, b in wins)
