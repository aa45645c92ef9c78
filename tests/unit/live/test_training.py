"""The training object (:class:`elasticzero.live.Training`, through the example's ``training``): its save rule
(whether a round's member takes the last committed step's checkpoint — a collective — is decided only over what every
member of the round agrees on: :func:`due` and the round kit's ``held``, fresh at every round), the flags live mode
refuses, the last save after the loop taken in a round announced before it, and a user's own error inside a live step
raised at once with its own traceback. The join race the rule fixes, end to end under agents:
tests/integration/elastic/test_live_e2e.py."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elasticzero.checkpoint.commit import step_dir
from elasticzero.errors import UsageError
from elasticzero.live import Hooks, Training
from elasticzero.live.loop import Attempt, carry, held_state, resume_point
from elasticzero.live.reshard import ReshardPlan
from elasticzero.live.training import due, takes_model
from elasticzero.rounds import ROUND_FILE_ENV, NodeRound, StoreAddress, write_round
from ez_testing import REPO, free_port

pytestmark = pytest.mark.timeout(120)

SAVE, TOTAL = 5, 20
STEPS = 2  # a whole live job's (the last step's save after the loop)


@pytest.fixture
def train_gpt(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # as Python does for the script: its gpt.py beside it
    import train_gpt

    return train_gpt


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A world-size-1 gloo default group (each round's group in these tests), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device rule sees a CPU machine (as in test_loop_rules.py): on a GPU one the round's group would be NCCL."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_save_step_is_due_once_per_round() -> None:
    assert due(10, SAVE, TOTAL, None)
    assert not due(10, SAVE, TOTAL, 10)  # this round's checkpointer saved it already
    assert not due(11, SAVE, TOTAL, 10)  # not a save step
    assert due(TOTAL, 0, TOTAL, None)  # the job's last step, also without --save-every
    assert not due(0, SAVE, TOTAL, None)  # nothing committed yet
    assert not due(15, SAVE, TOTAL, 15)  # the step the first round resumed from disk


def job(train_gpt: Any, tmp_path: Path, *flags: str, ckpt: str = "ckpt") -> Training:
    config = REPO / "examples" / "configs" / "gpt.yaml"
    argv = ["--config", str(config), "--zero", "2", "--size", "tiny", "--seq-len", "32", "--corpus-bytes", "4700"]
    argv += ["--cache-dir", str(tmp_path / "corpus"), "--checkpoint-dir", str(tmp_path / ckpt), *flags]
    training: Training = train_gpt.training(train_gpt.parser().parse_args(argv))
    training.leave_process = False  # a test goes on after it
    return training


class Saves(Hooks):
    """Records the checkpoint phases seen (one ``manifest`` per save taken)."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def checkpoint_phase(self, training: Training, phase: str, step: int) -> None:
        if phase == "manifest":
            self.taken.append(step)


def at_step(training: Training, step: int) -> None:
    """The training as if its last committed step were ``step`` (the round's value, its kit kept)."""
    training.rounds.now = replace(training.rounds.now, step=step)


def new_round(training: Training) -> None:
    """What entering a round builds afresh on every member: the kit (pieces, checkpointer: nothing held)."""
    training.rounds.now = replace(training.rounds.now, built=training._build(dist.group.WORLD))


@pytest.mark.parametrize("old_round_saved", [False, True], ids=["announced-before-the-save", "after-the-save"])
def test_a_survivor_and_a_fresh_joiner_take_the_same_saves_in_the_new_round(
    train_gpt: Any, world_of_one: None, tmp_path: Path, old_round_saved: bool
) -> None:
    """The survivor commits save step 10 alone; a join's round is announced before its save ran (the race the bench
    hit: the survivor then took the save alone in the new round, while the fresh joiner trained — mismatched
    collectives, the round hung until the hang watch killed the survivor) or after it. In the new round both are at
    step 10 and both take step 10's checkpoint, once. (Each a world of one here, with a directory of its own.)"""
    flags = ["--steps", str(TOTAL), "--save-every", str(SAVE)]
    survivor, joiner = (
        job(train_gpt, tmp_path, *flags, ckpt="survivor"),
        job(train_gpt, tmp_path, *flags, ckpt="joiner"),
    )
    saves = {"survivor": Saves(), "joiner": Saves()}
    survivor.hooks, joiner.hooks = (saves["survivor"],), (saves["joiner"],)
    with survivor, joiner:
        at_step(survivor, 10)
        if old_round_saved:
            survivor._due(Attempt(survivor.rounds), [])  # the old round's save
        new_round(survivor)
        new_round(joiner)
        at_step(joiner, 10)  # its peers' step
        for training in (survivor, joiner):
            for _ in range(2):  # the attempt at step 11, then one redone in the same round: the save is taken once
                training._due(Attempt(training.rounds), [])
    assert saves["survivor"].taken == [10] * (1 + old_round_saved) and saves["joiner"].taken == [10]
    assert all((tmp_path / who / step_dir(10)).is_dir() for who in saves)


def test_live_mode_refuses_async_save_and_ddp(train_gpt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any round is formed (nothing launched, nothing written): one line naming the flag; ZeRO stage 0
    (DDP, nothing to reshard) when the first round builds."""
    monkeypatch.setenv(ROUND_FILE_ENV, str(tmp_path / "round.json"))
    with pytest.raises(UsageError, match=r"^async_save \(--async-save\): not under --live-recovery"):
        job(train_gpt, tmp_path, "--steps", "4", "--async-save")
    assert not dist.is_initialized() and not (tmp_path / "ckpt").exists()


class Announcing(Hooks):
    """Writes round 1 into the round file at the start of the attempt after the last step (before its save)."""

    def __init__(self, path: str, round_: NodeRound) -> None:
        self.path, self.round, self.before, self.saved_by = path, round_, None, None

    def before_save(self, training: Training, attempt: Any) -> None:
        if training.step == STEPS and self.before is None:
            self.before = training.kit.checkpointer
            write_round(self.path, self.round)

    def checkpoint_phase(self, training: Training, phase: str, step: int) -> None:
        self.saved_by = training.kit.checkpointer


def test_the_last_save_after_the_loop_is_taken_in_the_round_announced_before_it(
    train_gpt: Any, tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Training in a world of one under a round file: round 1 is announced after the last step's commit,
    before its save after the loop (what a peer lost or a node joining there announces). The save leaves for round 1
    (entered in this process, the state carried over) and is taken there, once, by round 1's checkpointer."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    monkeypatch.setenv(ROUND_FILE_ENV, path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    training = job(train_gpt, tmp_path, "--steps", str(STEPS))
    hook = Announcing(path, NodeRound(1, 1, ((0, 0),), store, "r1/"))
    training.hooks = (hook,)
    try:
        with training:
            committed = [done.step for done in training if done.loss is not None]
    finally:
        if hasattr(training, "rounds"):  # the last round's group stays the default group: leave it
            training.rounds.groups.abandon()  # type: ignore[attr-defined]
    assert committed == [1, 2]
    assert [(e.round.number, e.step) for e in training.events] == [(1, STEPS)]  # entered at the last step
    assert [s for s, _ in training.rounds.record] == list(range(STEPS))
    assert hook.saved_by is not hook.before and training.kit.held == STEPS
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step")) == [step_dir(STEPS)]


class Failing:
    """The example's loss, raising ``error`` at step 2's first micro-batch."""

    def __init__(self, training: Training, error: BaseException) -> None:
        self.training, self.loss, self.error = training, training.loss, error

    def __call__(self, net: Any, batch: Any) -> torch.Tensor:
        if self.training.step == 1:
            raise self.error
        return self.loss(net, batch)


@pytest.mark.parametrize(
    "error", [ValueError("a bad label"), torch.OutOfMemoryError("CUDA out of memory (simulated)")], ids=["value", "oom"]
)
def test_a_users_own_error_in_a_live_step_is_raised_at_once_with_its_traceback(
    train_gpt: Any, tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """A ValueError in the loss, an out-of-memory (a RuntimeError) — the step's own errors, not a lost peer's — leave
    a live job at once with their own traceback, not after the bound's failure grace (30 s) spent waiting for a round
    the agent will not write."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    monkeypatch.setenv(ROUND_FILE_ENV, path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    training = job(train_gpt, tmp_path, "--steps", "4")
    training.loss = Failing(training, error)
    t0 = 0.0
    try:
        with pytest.raises(type(error)) as raised, training:
            for _ in training:
                t0 = time.monotonic()  # step 1 committed: step 2's attempt begins
    finally:
        if hasattr(training, "rounds"):
            training.rounds.groups.abandon()  # type: ignore[attr-defined]
    took = time.monotonic() - t0
    assert raised.value is error and took < 2.0, took  # 2 s: one tiny step's forward, far below the 30 s grace
    frames = [f.name for f in traceback.extract_tb(raised.tb)]
    assert frames[-1] == "__call__" and "_train_step" in frames  # raised where it happened, not re-raised later


def test_a_users_own_error_in_a_live_round_s_build_is_raised_at_once_with_its_traceback(
    train_gpt: Any, tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round's build runs bounded on the bound's helper thread (a member frozen in its collectives is left for
    the next round); an error of the user's build itself is raised at once, with the build's own frames, not after
    the bound's failure grace (30 s)."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    monkeypatch.setenv(ROUND_FILE_ENV, path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    training = job(train_gpt, tmp_path, "--steps", "4")

    def users_build(group: Any, device: torch.device) -> Any:
        raise ValueError("a bad model config")

    training.user_build = users_build
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match="a bad model config") as raised, training:
            pass
    finally:
        if hasattr(training, "rounds"):
            training.rounds.groups.abandon()  # type: ignore[attr-defined]
        else:  # the entry failed: the round's group it formed is left here
            dist.destroy_process_group()
    took = time.monotonic() - t0
    assert took < 10.0, took  # the group's formation and a thread hand-off, far below the 30 s grace
    assert [f.name for f in traceback.extract_tb(raised.tb)][-1] == "users_build"


SCHEDULED = """\
zero: {stage: 2}
precision: {dtype: fp32, loss_scale: {enabled: true, init_scale: 1024, growth_interval: 2}}
optimizer: {type: AdamW, params: {lr: 2.0e-3}}
scheduler: {type: WarmupDecayLR, params: {warmup_min_lr: 0.0, warmup_max_lr: 2.0e-3, warmup_num_steps: 3,
                                          total_num_steps: 8, warmup_type: linear}}
clip_grad_norm: 1.0
train_batch_size: 16
micro_batch_size: 4
"""


def scheduled(tmp_path: Path) -> str:
    """A config with an LR schedule and a dynamic loss scale that both move every step or two."""
    path = tmp_path / "scheduled.yaml"
    path.write_text(SCHEDULED)
    return str(path)


def engine_state(training: Training) -> tuple[int, float, float, int]:
    """The schedule's iteration and the learning rate it set, the loss scale and the steps it skipped."""
    pieces = training.pieces
    lr = float(pieces.optimizer.param_groups[0]["lr"])
    return pieces.scheduler.last_batch_iteration, lr, pieces.scaler.get_scale(), pieces.scaler.skipped_steps


def uninterrupted(steps: int) -> list[tuple[int, float, float, int]]:
    """The reference: after each of ``steps`` clean steps, the schedule's iteration and learning rate (a fresh
    schedule of the config's stepped alone) and the scale (doubled every ``growth_interval`` = 2 clean steps)."""
    from elasticzero.engine.lr_schedules import build_schedule

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0e-3)
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 2.0e-3, "warmup_num_steps": 3, "total_num_steps": 8}
    sched = build_schedule(opt, "WarmupDecayLR", {**params, "warmup_type": "linear"})
    out = []
    for k in range(1, steps + 1):
        opt.step()  # no gradient: nothing moves (the order torch expects before the schedule's step)
        sched.step()
        out.append((k - 1, float(opt.param_groups[0]["lr"]), 1024.0 * 2 ** (k // 2), 0))
    return out


class Recording(Hooks):
    """Announces round 1 at step ``at`` and records the engine state after every committed step. ``after_gate``: the
    announcement is seen inside the optimizer step of step ``at`` after its commit gate and update, by a wait that
    failed there (as a post-gate wait of the stage would on a lost peer: the reshard counts the step done, one step
    past the survivor's committed one); else after step ``at``'s commit, before the next attempt, by a bounded wait
    between the steps (the reshard at the survivor's step). Round 1 has the same member: a failed wait and one
    between steps take it at once, where a step would have finished first (the switch step)."""

    def __init__(self, path: str, round_: NodeRound, at: int, after_gate: bool) -> None:
        self.path, self.round, self.at, self.after_gate = path, round_, at, after_gate
        self.seen = list[tuple[int, float, float, int]]()
        self.synced: list[bool] = []

    def started(self, training: Training) -> None:
        self.synced = [training.pieces.optimizer.options.sync_module_states]  # the job's first round: broadcast
        if self.after_gate:  # after the copies' own post-step hook (it counts the step in the census)
            training.pieces.optimizer.optim.register_step_post_hook(lambda *_: self._in_step(training))

    def _in_step(self, training: Training) -> None:
        if training.step == self.at:
            write_round(self.path, self.round)
            failed = RuntimeError("a peer's connection closed")  # leaves the step with Reconfigure, as a failed wait
            training.rounds.bound.after_failure(failed)

    def after_step(self, training: Training, done: Any) -> None:
        self.seen.append(engine_state(training))
        if done.step == self.at and not self.after_gate:
            write_round(self.path, self.round)
            assert not training.bounded(lambda: None)  # between two steps: the round is entered here


@pytest.mark.parametrize("after_gate", [False, True], ids=["between-steps", "after-the-gate"])
def test_the_lr_schedule_and_loss_scale_go_on_across_a_live_round_change(
    train_gpt: Any, tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch, after_gate: bool
) -> None:
    """A real Training in a world of one under a round file, with a WarmupDecayLR schedule and a dynamic loss scale:
    round 1 is announced at step 3; the round builds fresh pieces (schedule at iteration -1, scale at its start), and
    the engine state the survivor held is loaded into them — one taken step on when the reshard counted the step in
    flight done. The learning rate and the scale after every step are the uninterrupted run's — not the schedule's
    warmup started over, nor one step off."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    monkeypatch.setenv(ROUND_FILE_ENV, path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    steps, at = 6, 3
    training = job(train_gpt, tmp_path, "--steps", str(steps), "--config", scheduled(tmp_path))
    hook = Recording(path, NodeRound(1, 1, ((0, 0),), store, "r1/"), at, after_gate)
    training.hooks = (hook,)
    try:
        with training:
            committed = [done.step for done in training if done.loss is not None]
    finally:
        if hasattr(training, "rounds"):
            training.rounds.groups.abandon()  # type: ignore[attr-defined]
    assert committed == list(range(1, steps + 1))
    resumed = at + after_gate  # the step in flight counted done: the round resumed one step on
    assert [(e.round.number, e.step) for e in training.events] == [(1, resumed)]
    assert hook.seen == uninterrupted(steps)  # the same floats: the same schedule formula at the same iterations
    # the example's build takes sync_module_states: round 1 (this process held state) was built without the broadcast
    assert hook.synced + [training.pieces.optimizer.options.sync_module_states] == [True, False]


@pytest.mark.parametrize("behind", [0, 1], ids=["at-the-source-step", "the-step-in-flight-counted-done"])
def test_a_joiner_takes_the_sources_engine_state_at_the_resumed_step(
    train_gpt: Any, world_of_one: None, tmp_path: Path, behind: int
) -> None:
    """A fresh joiner's pieces (schedule at -1, scale at its start) get the source's engine state as the group's
    decision hands it (:func:`resume_point` over the all-gathered positions, the joiner's own None): at the source's
    step, or one step on when the reshard counted the source's step in flight done — then the joiner's schedule and
    scale are the source's after that step, taken."""
    source = job(train_gpt, tmp_path, "--steps", "4", "--config", scheduled(tmp_path), ckpt="source")
    joiner = job(train_gpt, tmp_path, "--steps", "4", "--config", scheduled(tmp_path), ckpt="joiner")
    with source, joiner:
        for _ in range(2):
            next(iter(source))  # two committed steps: the schedule and scale moved
        plan = ReshardPlan(2 + behind, {0: 0}, ())
        at = resume_point(plan, [(2, source.sampler.state_dict(), held_state(source.kit)), None])
        assert at is not None and at.behind == behind
        fresh = engine_state(joiner)
        carry(joiner.kit, at)
        if behind:
            next(iter(source))  # the step in flight, taken by the source
        assert engine_state(joiner) == engine_state(source) != fresh
        assert engine_state(joiner) == uninterrupted(2 + behind)[-1]


def test_a_build_that_takes_a_model_parameter_keeps_the_model() -> None:
    """``build(group, device, model=None)`` is handed a survivor's model; the two-argument form always builds one."""

    def keeps(group: Any, device: Any, model: Any = None) -> Any:
        return model

    def builds(group: Any, device: Any) -> Any:
        return None

    assert takes_model(keeps) and not takes_model(builds)
    assert not takes_model(print)  # a builtin without a signature Python can read: the two-argument form


def test_make_model_makes_a_live_process_s_first_model_before_its_group_and_hands_it_to_the_build(
    train_gpt: Any, tmp_path: Path, cpu_machine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make_model`` runs before the first round's group is formed (a joiner makes its model while its running peers
    train on: they switch once its formation starts) and the build is handed that model; a build that does not take
    a model is refused with it, before anything is formed."""
    path, store = str(tmp_path / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "r0/"))
    monkeypatch.setenv(ROUND_FILE_ENV, path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    training = job(train_gpt, tmp_path, "--steps", "1")
    made: list[tuple[torch.nn.Module, bool]] = []
    make = training.make_model
    assert make is not None  # the example's

    def recording(device: torch.device) -> torch.nn.Module:
        made.append((make(device), dist.is_initialized()))
        return made[-1][0]

    training.make_model = recording
    try:
        with training:
            assert [formed for _, formed in made] == [False]  # once, before any group
            assert training.model is made[0][0]
    finally:
        if hasattr(training, "rounds"):
            training.rounds.groups.abandon()  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=r"^Training\(make_model=\.\.\.\): the build must take the model"):
        Training(lambda group, device: None, training.loss, [], steps=1, make_model=make)  # type: ignore[arg-type]


def test_a_build_whose_kit_fails_releases_its_optimizer(tmp_path: Path, world_of_one: None) -> None:
    """What the user's build returned is released when the kit around it fails (the checkpointer's claim of its
    directory, a collective in a live round): its optimizer's hooks come off the model, which a later try wraps
    again — left on, they would take that try's gradients too."""
    (tmp_path / "taken").write_text("a file where the checkpoint directory should be")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def build(group: Any, device: torch.device) -> tuple[torch.nn.Module, Any]:
        from elasticzero.config import build_pieces

        cfg = {"train_batch_size": 1, "zero": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
        return model, build_pieces(model, cfg, process_group=group)

    training = Training(build, lambda net, batch: net(batch).sum(), [], steps=1, checkpoint_dir=tmp_path / "taken")
    with pytest.raises(FileExistsError):
        training._build(dist.group.WORLD)
    assert not model._forward_pre_hooks  # the optimizer's hook on the forward: off
