"""The hang decision (elasticzero.agent.progress): pure, over records, process states and a clock."""

from __future__ import annotations

import pytest

from elasticzero.agent.progress import (
    FLOOR_S,
    STEP_FACTOR,
    VICTIM_FACTOR,
    HangPlan,
    Observed,
    Watch,
    hang_plan,
    hang_timeout,
    observe,
    stopping,
    timeout_source,
    verdict,
)
from elasticzero.errors import UsageError
from elasticzero.progress import PROGRESS_FILE_ENV, ProgressRecord

FIXED = HangPlan(enabled=True, timeout_s=5.0, progress_dir="/p")
AUTO = HangPlan(enabled=True, timeout_s=None, progress_dir="/p")


def rec(
    pid: int,
    step: int = 1,
    collectives: int = 10,
    waiting: int = 0,
    beats: int | None = None,
    ns: int = 0,
    rounds: int = 0,
    bounded: int = 0,
) -> ProgressRecord:
    return ProgressRecord(pid, step if beats is None else beats, step, collectives, waiting, ns, rounds, bounded)


def w(rank: int, record: ProgressRecord | None, stopped: bool = False, local: int | None = None) -> Observed:
    return Observed(rank, rank if local is None else local, 100 + rank, record, stopped)


def run(plan: HangPlan, ticks: list[tuple[float, list[Observed]]]):
    """Observe each tick in turn; the verdict after the last."""
    watch = Watch()
    for now, workers in ticks:
        watch = observe(watch, workers, now)
    return verdict(watch, ticks[-1][1], ticks[-1][0], plan), watch


def test_plan_from_the_flag() -> None:
    default = hang_plan(None, {}, "job", 7)
    assert (default.enabled, default.timeout_s, default.progress_dir) == (True, None, "/tmp/elasticzero-progress-job-7")
    assert default.worker_env(1) == {PROGRESS_FILE_ENV: "/tmp/elasticzero-progress-job-7/rank1"}
    fixed = HangPlan(True, 12.5, "/scratch/elasticzero-progress-j-1")
    assert hang_plan("12.5", {"TMPDIR": "/scratch"}, "j", 1) == fixed
    for off in ("off", "0", "none"):
        plan = hang_plan(off, {}, "j", 1)
        assert not plan.enabled and plan.worker_env(0) == {}
    for bad in ("-3", "soon", "inf"):
        with pytest.raises(UsageError, match="--hang-timeout"):
            hang_plan(bad, {}, "j", 1)


def test_a_worker_is_watched_from_its_first_step() -> None:
    starting = [w(0, rec(100, step=0, beats=0))]  # the engine is built (collectives), no step yet: loading, warm-up
    assert run(FIXED, [(0.0, starting), (60.0, starting)])[0] is None
    assert run(FIXED, [(0.0, [w(0, None)]), (60.0, [w(0, None)])])[0] is None  # no record: not watched at all


def test_a_stalled_worker_outside_the_collectives_is_hung_at_the_timeout() -> None:
    ranks = [w(0, rec(100, step=4, collectives=37))]
    assert run(FIXED, [(0.0, ranks), (4.9, ranks)])[0] is None
    hang, _ = run(FIXED, [(0.0, ranks), (5.0, ranks)])
    assert hang is not None and (hang.rank, hang.step, hang.idle_s, hang.stopped) == (0, 4, 5.0, False)
    assert hang.where == "outside the engine's collectives, after its collective #37 (its peers wait for it)"


def test_a_worker_stopped_as_hung_is_not_named_again() -> None:
    """The kill takes a tick or more to show as a failure (torch reaps the process): no second hang line for it."""
    ranks = [w(0, rec(100, step=4, collectives=37))]
    hang, watch = run(FIXED, [(0.0, ranks), (5.0, ranks)])
    assert hang is not None
    watch = stopping(watch, hang.pid)
    assert verdict(observe(watch, ranks, 5.7), ranks, 5.7, FIXED) is None
    fresh = [Observed(0, 0, 200, rec(200, step=4, collectives=37))]  # another process in the slot is watched
    assert verdict(observe(observe(watch, fresh, 6.0), fresh, 11.0), fresh, 11.0, FIXED) is not None


def test_progress_restarts_the_clock() -> None:
    ticks = [(0.0, [w(0, rec(100, step=4))]), (3.0, [w(0, rec(100, step=4, collectives=11))])]
    assert run(FIXED, [*ticks, (7.9, ticks[-1][1])])[0] is None  # idle since 3.0
    assert run(FIXED, [*ticks, (8.0, ticks[-1][1])])[0] is not None
    waits = [(0.0, [w(0, rec(100, waiting=11))]), (4.0, [w(0, rec(100, waiting=0))])]  # a wait that ended
    assert run(FIXED, [*waits, (8.9, waits[-1][1])])[0] is None


def test_a_worker_waiting_in_a_collective_is_left_to_the_hung_ranks_agent() -> None:
    victim = [w(0, rec(100, collectives=38, waiting=38))]
    assert run(FIXED, [(0.0, victim), (5.0 * VICTIM_FACTOR - 0.1, victim)])[0] is None
    hang, _ = run(FIXED, [(0.0, victim), (5.0 * VICTIM_FACTOR, victim)])
    assert hang is not None and hang.where.startswith("waiting in engine collective #38 (no rank of this node")


def test_the_rank_behind_is_named_and_a_stopped_one_first() -> None:
    waiting, behind = w(0, rec(100, collectives=38, waiting=38)), w(1, rec(101, collectives=37))
    hang, _ = run(FIXED, [(0.0, [waiting, behind]), (5.0, [waiting, behind])])
    assert hang is not None and hang.rank == 1
    also_idle = w(2, rec(102, collectives=36))
    stopped = w(3, rec(103, collectives=38, waiting=38), stopped=True)  # stopped inside the collective
    hang, _ = run(FIXED, [(0.0, [also_idle, stopped]), (5.0, [also_idle, stopped])])
    assert hang is not None and (hang.rank, hang.stopped) == (3, True)
    assert hang.where == "stopped (SIGSTOP or a debugger): it cannot dump its stacks"
    victims = [w(0, rec(100, collectives=38, waiting=38)), w(1, rec(101, collectives=38, waiting=38))]
    hang, _ = run(FIXED, [(0.0, victims), (10.0, victims)])
    assert hang is not None and hang.rank == 0


def test_a_new_process_in_the_slot_starts_afresh() -> None:
    old, new = w(0, rec(100, step=9)), Observed(0, 0, 200, rec(200, step=1))
    hang, watch = run(FIXED, [(0.0, [old]), (4.0, [new]), (8.0, [new])])
    assert hang is None and watch.seen[0].since == 4.0
    stale = Observed(0, 0, 200, rec(100, step=9))  # the last round's record, not yet replaced
    assert run(FIXED, [(0.0, [stale]), (60.0, [stale])])[0] is None


def test_the_default_timeout_follows_the_longest_step() -> None:
    assert hang_timeout(AUTO, []) == FLOOR_S and timeout_source(AUTO, []) == "the floor: no step interval seen yet"
    ticks = [(float(t), [w(0, rec(100, step=s, ns=int(s * 0.5e9)))]) for t, s in ((0, 1), (1, 3), (2, 4))]
    _, watch = run(AUTO, ticks)
    assert watch.gaps == (0.5, 0.5)  # two steps in 1 s, then one in 0.5 s: per step, from the workers' own clock
    assert hang_timeout(AUTO, watch.gaps) == FLOOR_S  # 10 x 0.5 s is below the floor
    assert hang_timeout(AUTO, [0.5, 4.0, 1.0]) == STEP_FACTOR * 4.0
    assert timeout_source(AUTO, [4.0]) == f"max({FLOOR_S:g} s, {STEP_FACTOR:g} x the longest step, 4.00 s)"
    assert hang_timeout(FIXED, [100.0]) == 5.0 and timeout_source(FIXED, [1.0]) == "--hang-timeout"


def test_off_decides_nothing() -> None:
    ranks = [w(0, rec(100))]
    assert run(hang_plan("off", {}, "j", 1), [(0.0, ranks), (1e6, ranks)])[0] is None


STEP_S = 0.5  # the workers' step in the round-change tests; the change itself takes CHANGE_S
CHANGE_S = 5.5  # detection + re-rendezvous + reshard: STEP_FACTOR x CHANGE_S is above the floor


def stepped(step: int, at_s: float, rounds: int = 0) -> list[Observed]:
    """Rank 0 after ``step`` at ``at_s`` s of its clock (1 s on: a step time of 0 reads as none)."""
    return [w(0, rec(100, step=step, ns=int((1.0 + at_s) * 1e9), rounds=rounds))]


def test_an_interval_across_a_live_round_change_is_no_step() -> None:
    """However the agent's ticks fall around the change, the interval that spans it is not a step length."""
    before = [(0.0, stepped(1, 0.0)), (1.0, stepped(2, STEP_S))]
    after = 2 * STEP_S + CHANGE_S  # the first step in the new round
    entered = [w(0, rec(100, step=2, ns=0, rounds=1))]  # the round entered: no step in it yet
    orders = {
        "entry seen": [*before, (2.0, entered), (8.0, stepped(3, after, 1)), (9.0, stepped(4, after + STEP_S, 1))],
        "entry unseen": [*before, (8.0, stepped(3, after, 1)), (9.0, stepped(4, after + STEP_S, 1))],
    }
    for order, ticks in orders.items():
        _, watch = run(AUTO, ticks)
        assert watch.gaps == (STEP_S, STEP_S), order
        assert hang_timeout(AUTO, watch.gaps) == max(FLOOR_S, STEP_FACTOR * STEP_S), order
    counted = [*before, (8.0, stepped(3, after)), (9.0, stepped(4, after + STEP_S))]  # no round entered: a slow step
    assert max(run(AUTO, counted)[1].gaps) == after - STEP_S and STEP_FACTOR * (after - STEP_S) > FLOOR_S


def test_a_worker_in_a_new_round_is_watched_from_its_first_step_there() -> None:
    """Like a started worker: the reshard (or a joiner's state transfer) and the first step are not watched."""
    entered = [w(0, rec(100, step=2, ns=0, rounds=1))]
    assert run(FIXED, [(0.0, stepped(2, 0.0)), (1.0, entered), (60.0, entered)])[0] is None
    first = stepped(3, 61.0, rounds=1)
    ticks = [(0.0, stepped(2, 0.0)), (1.0, entered), (61.0, first)]
    assert run(FIXED, [*ticks, (65.9, first)])[0] is None
    hang, _ = run(FIXED, [*ticks, (66.0, first)])
    assert hang is not None and (hang.step, hang.idle_s) == (3, 5.0)


def test_a_worker_in_a_bounded_wait_outside_the_engine_is_said_to_be_there() -> None:
    """The live loop's save on its helper thread: a wait the engine's collectives do not show."""
    saving = [w(0, rec(100, step=60, collectives=37, bounded=1))]
    hang, _ = run(FIXED, [(0.0, saving), (5.0, saving)])
    assert hang is not None and hang.where == (
        "in a bounded wait of the live loop on work outside the engine's collectives (on its helper thread: a "
        "checkpoint save's collectives, say), after its engine collective #37"
    )
    in_engine = [w(0, rec(100, collectives=38, waiting=38, bounded=1))]  # an engine collective waited on the thread
    hang, _ = run(FIXED, [(0.0, in_engine), (5.0 * VICTIM_FACTOR, in_engine)])
    assert hang is not None and hang.where.startswith("waiting in engine collective #38")
    leaves = [(0.0, saving), (4.0, [w(0, rec(100, step=60, collectives=37))])]  # the wait ended: progress
    assert run(FIXED, [*leaves, (8.9, leaves[-1][1])])[0] is None
