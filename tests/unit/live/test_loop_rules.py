"""The loop's rules: where a round's training goes on (the group's decision over the reshard plan and the members'
sampler positions), the sampler re-cut at another world size, the round file and local rank at start; and a whole
LiveTraining in a world of one (an in-process gloo group): started from its round file, then a second round with the
same member — a fresh default group in the same process, the state carried over, the step and samples kept."""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticzero.data.sampler import ElasticSampler
from elasticzero.engine.zero.stage2 import ZeroStage2
from elasticzero.errors import UsageError
from elasticzero.live import loop
from elasticzero.live.bounded import LiveError, Reconfigure
from elasticzero.live.copies import BuddyCopies
from elasticzero.live.loop import (
    LiveTraining,
    ReshardFallback,
    ResumeAt,
    first_round,
    local_rank_of,
    recut,
    resume_point,
    warm_up,
)
from elasticzero.live.reshard import Fallback, ReshardPlan
from elasticzero.rounds import ROUND_FILE_ENV, NodeRound, StoreAddress, write_round
from ez_testing import free_port

pytestmark = pytest.mark.timeout(60)


def sampler(rank: int, world: int) -> ElasticSampler:
    return ElasticSampler(48, global_batch_size=12, micro_batch_size=2, rank=rank, world_size=world, seed=3)


def test_the_resampled_world_takes_the_same_global_batches() -> None:
    old = [sampler(r, 3) for r in range(3)]
    for s in old:
        s.advance(2 * s.accumulation_steps)  # two global batches committed at world 3
    new = [recut(old[0], old[0].state_dict(), 0, r, 2) for r in range(2)]
    want = [sampler(0, 1).micro_batch(0, 24 + i) for i in range(0, 12, 2)]
    got = [s.micro_batch(s.epoch, s.consumed + p) for p in range(0, 12, 4) for s in new]
    assert sorted(i for mb in got for i in mb) == sorted(i for mb in want for i in mb)
    assert all(s.consumed == 24 and s.world_size == 2 and s.accumulation_steps == 3 for s in new)
    assert recut(old[0], old[0].state_dict(), 1, 0, 2).consumed == 36  # one global batch on


PLAN = ReshardPlan(5, {0: 1, 1: 1}, ())
AT4 = {"consumed_samples": 48}
ENGINE = {"scheduler": {"last_batch_iteration": 3}, "scaler": {"scale": 1024.0, "growth_tracker": 1}}


def test_nobody_holding_state_is_the_jobs_first_round() -> None:
    assert resume_point(Fallback("no rank holds any state", nothing_held=True), [None, None]) is None


def test_a_joiner_learns_the_step_position_and_engine_state_from_the_source() -> None:
    assert resume_point(PLAN, [None, (5, AT4, ENGINE)]) == ResumeAt(5, AT4, 0, ENGINE)
    assert resume_point(PLAN, [None, (4, AT4, ENGINE)]) == ResumeAt(5, AT4, 1, ENGINE)  # step 4's gate passed
    other = {"scheduler": {"last_batch_iteration": 9}}  # a survivor that is not the source: its state is not taken
    assert resume_point(PLAN, [(5, AT4, other), (5, AT4, ENGINE)]) == ResumeAt(5, AT4, 0, ENGINE)


def test_a_lost_state_is_the_restart_path_and_a_far_source_a_live_error() -> None:
    with pytest.raises(ReshardFallback, match=r"both copies .* \[2\]"):
        resume_point(Fallback("both copies of the state of old rank(s) [2] are lost", (2,)), [None])
    with pytest.raises(LiveError, match="at step 5, its source's sampler at 3"):
        resume_point(PLAN, [None, (3, AT4, ENGINE)])


def test_the_round_file_and_local_rank_at_start_are_usage_errors_when_wrong(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=f"{ROUND_FILE_ENV} is not set"):
        first_round({})
    path = tmp_path / "round.json"
    with pytest.raises(UsageError, match="no round file"):
        first_round({ROUND_FILE_ENV: str(path)})
    path.write_text("{")
    with pytest.raises(UsageError, match=f"{path}: not a round"):
        first_round({ROUND_FILE_ENV: str(path)})
    with pytest.raises(UsageError, match="LOCAL_RANK='x'"):
        local_rank_of({"LOCAL_RANK": "x"})


@pytest.fixture
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device rule sees a CPU machine: these tests build CPU models over gloo on any machine (on a GPU one it
    would bind the round's group to NCCL on ``cuda:0``, which a CPU tensor cannot use)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def build(group: Any) -> ZeroStage2:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return ZeroStage2(model, torch.optim.AdamW, lr=0.01, process_group=group)


def train(live: LiveTraining, total: int, data: torch.Tensor, seen: list[dict[str, torch.Tensor]]) -> None:
    """``total`` steps; ``seen``: the parameters each attempt starts from."""
    for attempt in live.steps(total):
        with attempt:
            seen.append({k: v.clone() for k, v in attempt.opt.full_state_dict().items()})
            for idx in attempt.micro_batches:
                attempt.model(data[idx]).pow(2).mean().backward()
            attempt.opt.step()
            attempt.opt.zero_grad()


def test_a_world_of_one_enters_a_second_round_in_the_same_process(tmp_path: Path, cpu_machine: None) -> None:
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path})
    seen: list[dict[str, torch.Tensor]] = []
    try:
        train(live, 2, data, seen)
        end_of_round0 = {k: v.clone() for k, v in live.opt.full_state_dict().items()}
        old_opt = live.opt
        write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
        train(live, 3, data, seen)  # the attempt of step 2 sees round 1 first: enters it, then trains step 2
        assert [(e.round.number, e.step) for e in live.events] == [(1, 2)]
        assert [s for s, _ in live.record] == [0, 1, 2] and live.sampler.consumed == 36
        assert live.opt is not old_opt and live.groups.current is dist.group.WORLD
        assert live.groups.abandoned == []  # round 0's gloo group: cut once round 1 settled, let go after its 1st step
        carried = seen[2]  # what the new optimizer, built afresh, started round 1 from
        assert all(torch.equal(carried[k], v) for k, v in end_of_round0.items())
    finally:
        live.close()
        live.groups.abandon()


def test_a_join_is_switched_to_at_the_step_its_members_agree_on(tmp_path: Path, cpu_machine: None) -> None:
    """The loop's decision for a newer round (:meth:`LiveTraining._announced`), once every member said it is ready:
    the first member to decide sets it in the round's store, and every member adopts what is there, whatever it reads
    itself. Round 2, whose other member trained in no round of this job's (a member lost or replaced: the step cannot
    complete), is taken at once anywhere, the NCCL watch's thread too (``loop=False``). Round 1 (this process and a
    fresh one) is a join: inside a step it is not taken — the switch step is the first boundary nobody can have
    passed, alone the next one — and the watch never takes it (the loop leaves at that boundary itself); a failed wait
    (urgent) takes it at once, and the loop from the agreed step on; a failed wait on round 6, not decided yet,
    decides at once for everyone (it leaves its step: theirs cannot complete). Between steps (idle) a join is taken
    at once.
    Rounds 4 and 5: a decision already in the store wins over what this process reads — at once for what looks like a
    join to it (a peer read an older ready value: one that had left its round, ``held``), a step for what does not."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the new rounds' store
    joined = StoreAddress("127.0.0.1", port, False)
    rounds = {n: NodeRound(n, 2, ((0, 1),), joined, f"r{n}/") for n in range(1, 7)}  # this process is rank 1
    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path})

    def announce(n: int, other: str, decided: str | None = None) -> Any:
        at = dist.PrefixStore(f"r{n}/", server)
        if decided is not None:
            at.set("switch_at", decided)
        write_round(path, rounds[n])
        at.set("ready/0", other)
        # TCPStore's set sends no reply: the server may read the loop's own connection first (a check right after
        # found ready/0 unset once in CI). A round trip on this connection lands the sets before anything reads them.
        at.check(["ready/0"])
        return at

    try:
        attempt = next(live.steps(10))
        with attempt:  # step 0
            r2 = announce(2, "0:5")  # not a member of round 0's
            assert live._announced(0, loop=False) == rounds[2] and r2.get("switch_at") == b"-1"
            assert live._announced(0) == rounds[2]
            r1 = announce(1, "new")
            assert live._announced(0, loop=False) is None and not r1.check(["switch_at"])  # the watch: no step
            assert live._announced(0) is None and r1.get("switch_at") == b"1" and r1.get("ready/1") == b"0:0"
            assert live._announced(0, loop=False) is None
            assert live._announced(0, urgent=True) == rounds[1] and r1.get("switch_at") == b"1"  # decided already
            r6 = announce(6, "new")
            assert live._announced(0, urgent=True) == rounds[6] and r6.get("switch_at") == b"-1"  # at once, for all
            announce(4, "new", decided="-1")
            assert live._announced(0) == rounds[4]
            announce(5, "0:5", decided="3")
            assert live._announced(0) is None
            r1 = announce(1, "new")
            for idx in attempt.micro_batches:
                attempt.model(data[idx]).pow(2).mean().backward()
            attempt.opt.step()
            attempt.opt.zero_grad()
        assert attempt.committed and live.step == 1
        assert live._announced(0) == rounds[1] and live._announced(0, loop=False) is None  # the loop's boundary
        r3 = announce(3, "new")
        assert live._announced(0) == rounds[3] and r3.get("switch_at") == b"1"  # idle between steps: at once
    finally:
        live.close()
        live.groups.abandon()


def test_a_member_that_left_its_round_says_so_and_drains_its_device_at_an_agreed_switch(
    tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ready values: a settled member says its round and rank, one that left it (an entry under way) ``held`` — a
    peer still in the old round then decides at once, never waits for it in a step. The drain (NCCL: leaving at a
    join's agreed step, its watch quiet): the device synchronised, bounded, on its device; not after an abort, not at
    once, not without a device."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path})
    synced: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    try:
        assert live._ready_value() == "0:0"
        live._leaving = True
        assert live._ready_value() == "held"
        live._leaving = False
        r7 = NodeRound(7, 1, ((0, 0),), store, "r7/")
        live._switch = (7, 3)
        live._drain(r7, False, live.bound)  # no device: the CPU
        live.where = dataclasses.replace(live.where, device="cuda:1", backend="nccl")  # its bound device
        live._drain(r7, True, live.bound)  # aborted by the watch already
        live._switch = (7, -1)
        live._drain(r7, False, live.bound)  # at once: the watch aborted, or a peer may be lost
        assert synced == []
        live._switch = (7, 3)
        live._drain(r7, False, live.bound)
        assert synced == [torch.device("cuda:1")]
    finally:
        live.close()
        live.groups.abandon()


@pytest.mark.parametrize("rebuild_takes_it", [True, False])
def test_a_round_whose_members_hold_state_builds_without_the_modules_broadcast(
    tmp_path: Path, cpu_machine: None, rebuild_takes_it: bool
) -> None:
    """Builds that take ``sync_module_states`` get False in a round a member holds state in (round 1: this process
    trained in round 0, its ready key says so) — the reshard writes the model whole — and nothing in the job's first
    round (the optimizer broadcasts, the default); where one of ``build`` and ``rebuild`` does not take it, neither
    is told (every member broadcasts, or none)."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    told: list[tuple[str, bool | None]] = []

    def fresh(group: Any, sync_module_states: bool | None = None) -> ZeroStage2:
        told.append(("build", sync_module_states))
        return build(group)

    def kept(group: Any, module: torch.nn.Module, sync_module_states: bool | None = None) -> ZeroStage2:
        told.append(("rebuild", sync_module_states))
        sync = {} if sync_module_states is None else {"sync_module_states": sync_module_states}
        return ZeroStage2(module, torch.optim.AdamW, lr=0.01, process_group=group, **sync)

    plain = lambda group, module: kept(group, module)  # noqa: E731 - a rebuild without the keyword
    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    env = {ROUND_FILE_ENV: path}
    live = LiveTraining.from_agent(fresh, sampler=sampler(0, 1), env=env, rebuild=kept if rebuild_takes_it else plain)
    try:
        train(live, 1, data, [])
        write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
        train(live, 2, data, [])
        assert [e.round.number for e in live.events] == [1]
        assert told == [("build", None), ("rebuild", False if rebuild_takes_it else None)]
        assert live.opt.options.sync_module_states is not rebuild_takes_it
    finally:
        live.close()
        live.groups.abandon()


def test_a_round_left_is_let_go_its_model_and_optimizer_collected(tmp_path: Path, cpu_machine: None) -> None:
    """The old round's optimizer (and its model, masters, state, copies) is released once the new round is entered:
    collected, not kept by its hooks on the old model's parameters for the life of the process."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path})
    try:
        train(live, 2, data, [])
        old_opt, old_model = weakref.ref(live.opt), weakref.ref(live.model)
        write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
        train(live, 3, data, [])
        gc.collect()
        assert [e.round.number for e in live.events] == [1] and old_opt() is None and old_model() is None
    finally:
        live.close()
        live.groups.abandon()


def test_a_newer_round_during_the_entry_starts_it_over_with_that_round(tmp_path: Path, cpu_machine: None) -> None:
    """Round 2 arrives while this process enters round 1 (here: while it builds; in a job, any bounded wait of the
    entry leaves with it): the entry starts over with round 2, from the same holdings — no LiveError."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    second = NodeRound(2, 1, ((0, 0),), store, "r2/")
    calls: list[int] = []

    def build_then_change(group: Any) -> ZeroStage2:
        calls.append(len(calls))
        if len(calls) == 2:  # entering round 1
            write_round(path, second)
            raise Reconfigure(second)
        return build(group)

    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    live = LiveTraining.from_agent(build_then_change, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path})
    seen: list[dict[str, torch.Tensor]] = []
    try:
        train(live, 1, data, seen)
        write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
        train(live, 2, data, seen)
        assert [(e.round.number, e.step) for e in live.events] == [(2, 1)] and live.round == second
        assert len(calls) == 3 and live.groups.abandoned == []  # rounds 0 and 1 left, both cut and let go
        assert [s for s, _ in live.record] == [0, 1]
    finally:
        live.close()
        live.groups.abandon()


def test_a_survivor_keeps_its_buffers_on_a_first_try_and_copies_the_model_off_them_on_a_retry(
    tmp_path: Path, cpu_machine: None
) -> None:
    """``rebuild``: the kept model comes back in the old optimizer's buffers on the entry's first try (the new wrap
    takes them over: the same storage), and copied off them on a try after an interrupted one (that try's build may
    have left a collective to land in them); the job trains on from the same state either way."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    second = NodeRound(2, 1, ((0, 0),), store, "r2/")
    handed: list[list[int]] = []

    def rebuild(group: Any, module: torch.nn.Module) -> ZeroStage2:
        handed.append([p.untyped_storage().data_ptr() for p in module.parameters()])
        if len(handed) == 1:  # entering round 1: round 2 arrives meanwhile
            write_round(path, second)
            raise Reconfigure(second)
        return ZeroStage2(module, torch.optim.AdamW, lr=0.01, process_group=group)

    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path}, rebuild=rebuild)
    try:
        train(live, 1, data, [])
        laid = [p.untyped_storage().data_ptr() for p in live.model.parameters()]
        write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
        train(live, 2, data, [])
        assert [(e.round.number, e.step) for e in live.events] == [(2, 1)] and [s for s, _ in live.record] == [0, 1]
        assert handed[0] == laid and not set(handed[1]) & set(laid)
    finally:
        live.close()
        live.groups.abandon()


def test_the_copies_options_reach_the_replicator_and_committed_says_which_attempts_counted(
    tmp_path: Path, cpu_machine: None
) -> None:
    """``replicate=False`` (a config's ``zero.copies.enabled``) turns the copies off in every round; ``committed``
    is True after a step that completed and False after one left for a new round (the ``with`` swallowed that)."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path}, replicate=False)
    outcomes: list[bool] = []
    try:
        assert live.copies.plan.reason == "replication is off"
        for attempt in live.steps(2):
            with attempt:
                if attempt.step == 1 and live.round.number == 0:  # a new round arrives inside the step
                    write_round(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
                    attempt.check()
                for idx in attempt.micro_batches:
                    attempt.model(data[idx]).pow(2).mean().backward()
                attempt.opt.step()
                attempt.opt.zero_grad()
            outcomes.append(attempt.committed)
        assert outcomes == [True, False, True] and [s for s, _ in live.record] == [0, 1]
        assert live.round.number == 1 and live.copies.plan.reason == "replication is off"
    finally:
        live.close()
        live.groups.abandon()


def test_every_copies_option_reaches_each_rounds_replicator(
    tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, Any]] = []

    def recording(opt: Any, **options: Any) -> BuddyCopies:
        seen.append({k: options[k] for k in ("enabled", "node_shift", "overlap", "early")})
        return BuddyCopies(opt, **options)

    monkeypatch.setattr(loop, "BuddyCopies", recording)
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    options = {"replicate": False, "node_shift": 3, "overlap": False, "early": False}
    live = LiveTraining.from_agent(build, sampler=sampler(0, 1), env={ROUND_FILE_ENV: path}, **options)
    try:
        assert seen == [{"enabled": False, "node_shift": 3, "overlap": False, "early": False}]
    finally:
        live.close()
        live.groups.abandon()


def test_warm_up_pays_the_first_optimizer_s_imports_and_freezes_the_start_up_objects() -> None:
    """What a joiner pays before it says ready (its running peers train on meanwhile): torch's first optimizer's
    imports (its compiler stack: ``Optimizer.__init__`` imports ``torch._dynamo`` once), and the objects alive then
    moved out of the collector's sight, so the let-go's full collection after a round change scans the rounds' own;
    garbage is collected first, not frozen."""

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    alive, dropped = Cycle(), Cycle()
    collected = weakref.ref(dropped)
    del dropped
    try:
        warm_up()
        assert "torch._dynamo" in sys.modules  # a fact of torch's, checked here: the import is the cost paid
        assert gc.get_freeze_count() > 0 and collected() is None  # the garbage cycle was collected, not frozen
        assert not any(o is alive for o in gc.get_objects())  # frozen: out of the collector's generations
    finally:
        gc.unfreeze()
