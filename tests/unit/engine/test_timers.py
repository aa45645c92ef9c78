"""PhaseTimers: structure, counts and bookkeeping (never speeds)."""

from __future__ import annotations

import pytest

from elasticzero.engine.timers import PhaseTimers


def test_disabled_records_nothing_and_shares_one_noop_context() -> None:
    t = PhaseTimers()
    assert t.enabled is False
    assert t.phase("forward") is t.phase("backward")  # no allocation per call when off
    with t.phase("forward"):
        pass
    t.start("x")
    assert t.stop("x") == 0.0
    t.count(samples=8, tokens=64)
    assert t.summary()["phases"] == {}
    assert (t.samples, t.tokens, t.wall_s) == (0, 0, 0.0)
    assert t.format() == "timers: nothing measured (disabled)"


def test_phases_count_accumulate_and_keep_first_seen_order() -> None:
    t = PhaseTimers(enabled=True)
    for _ in range(3):
        with t.phase("forward"):
            with t.phase("reduce"):  # nesting is allowed
                pass
        with t.phase("backward"):
            pass
        t.count(samples=4, tokens=32)
    s = t.summary()
    assert list(s["phases"]) == ["reduce", "forward", "backward"]
    assert {name: p["count"] for name, p in s["phases"].items()} == {"reduce": 3, "forward": 3, "backward": 3}
    for p in s["phases"].values():
        assert 0.0 <= p["max_s"] <= p["total_s"]
        assert p["mean_s"] == pytest.approx(p["total_s"] / 3)
    # nested phases lie inside the wall span, so the span covers the outer phases, not their sum with inner ones
    assert s["wall_s"] >= s["phases"]["forward"]["total_s"] + s["phases"]["backward"]["total_s"] - 1e-9
    assert (s["samples"], s["tokens"]) == (12, 96)
    if s["wall_s"] > 0:
        assert s["samples_per_s"] == pytest.approx(12 / s["wall_s"])
        assert s["tokens_per_s"] == pytest.approx(96 / s["wall_s"])


def test_totals_are_monotonic_and_stop_returns_elapsed() -> None:
    t = PhaseTimers(enabled=True)
    totals = []
    for _ in range(4):
        t.start("step")
        elapsed = t.stop("step")
        assert elapsed >= 0.0
        totals.append(t.summary()["phases"]["step"]["total_s"])
    assert totals == sorted(totals)


def test_phase_is_recorded_even_when_the_body_raises() -> None:
    t = PhaseTimers(enabled=True)
    with pytest.raises(ZeroDivisionError), t.phase("forward"):
        1 / 0  # noqa: B018
    assert t.summary()["phases"]["forward"]["count"] == 1
    t.start("forward")  # not left running
    t.stop("forward")


def test_start_stop_misuse_is_an_error() -> None:
    t = PhaseTimers(enabled=True)
    t.start("allgather")
    with pytest.raises(RuntimeError, match="already running"):
        t.start("allgather")
    with pytest.raises(RuntimeError, match="was not started"):
        t.stop("reduce")


def test_format_and_reset() -> None:
    t = PhaseTimers(enabled=True, synchronize=True)  # synchronize is a no-op without CUDA
    with t.phase("forward"):
        pass
    t.count(samples=2)
    line = t.format()
    assert line.startswith("forward ") and "ms x1" in line and "samples/s" in line and "tokens/s" not in line
    t.reset()
    assert t.summary() == {
        "phases": {},
        "wall_s": 0.0,
        "samples": 0,
        "tokens": 0,
        "samples_per_s": 0.0,
        "tokens_per_s": 0.0,
    }
    assert t.format() == "timers: nothing measured"
