"""Driver of test_live_loop: ``live_loop_worker.py OUT`` runs every case of :data:`CASES` (torch imported once, here).
It forks the ranks, each a node of its own with its own round file, that train the tiny GPT at ZeRO-``stage`` in
:meth:`LiveTraining.from_agent <elasticzero.live.LiveTraining.from_agent>`, and plays the agent: it hosts the store
(outside the ranks), writes round 0 into every rank's round file before forking it, and at the membership change
writes round 1 (a new world, a new prefix) into the files of the round's members:

- a loss (``KILL``/``STOP``; ``KILL2``: two ranks at once): at step ``K`` the victim (rank 2; ranks 1 and 2 in
  ``KILL2``), after every rank's shards were gathered and saved (``OUT.<case>.at_k.pt``: the start of the reference
  run), sends itself the signal; the driver sees it die or stop, writes round 1 of the survivors and fences the victim;
- a join (``JOIN``): two ranks train; at step ``K`` (the state saved as above) they wait inside the step until the
  driver says go; meanwhile it forks a fresh third process with round 1 (world 3) in its file — rank 0, as a returning
  first host is: the round's build broadcasts the module from the one member whose model is fresh, before the reshard
  reads what the two hold (their models' buffers, taken over) — and once it is ready (its ready key in the store)
  writes round 1 into the two's files, then says go: the two learn of a ready join inside step ``K`` and finish it,
  and the next one (the switch step agreed, :func:`~elasticzero.rounds.switch_proposal`: inside a step of a world of
  two, two steps on), at the old world — no attempt left — and switch at ``K + 2``;
- a joiner lost before it arrives (``JOINLOST``): the two wait between steps ``K - 1`` and ``K`` (a bounded wait: a
  round is taken at once there) while round 1 names a third process that never comes (a joiner killed while its
  interpreter starts); they wait for its ready key, and train on, until the driver writes round 2 (world 2);
- a joiner frozen in the round's build (``JOINSTOP``): as ``JOINLOST``, but the fresh process comes and SIGSTOPs
  itself at the start of its ``build``, once round 1's group has formed — the two are then in their own builds, in
  the engine's broadcast of the module's state, which it never joins; the driver writes round 2 (world 2).

Every round's ``build`` puts a WarmupDecayLR schedule on the optimizer (:class:`Built`: a world-independent piece the
round change carries from a peer); each step's learning rate is recorded.

Each rank writes ``OUT.<case>.rank<r>.json`` (pid, sample record, reconfigurations with monotonic times, the learning
rate of each committed step); rank 0 the
final parameters (``OUT.<case>.final.pt``); the driver ``OUT.<case>.harness.json`` (pids, exit codes, when it wrote
round 1). A rank that ends in a :class:`~elasticzero.live.LiveError` (the restart path) writes it to
``OUT.<case>.rank<r>.live_error`` and exits 3."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))  # the tiny GPT
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))  # full_state
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ckpt_model import full_state

from elasticzero.data.sampler import ElasticSampler
from elasticzero.engine.lr_schedules import DeepSpeedSchedule, WarmupDecayLR
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.stage1 import ZeroStage1
from elasticzero.engine.zero.stage2 import ZeroStage2
from elasticzero.engine.zero.stage3 import ZeroStage3
from elasticzero.live import LiveError, LiveTraining
from elasticzero.rounds import ROUND_FILE_ENV, NodeRound, StoreAddress, ready_key, write_round
from ez_testing import free_port
from gpt import GPT, config_for

K, TOTAL = 3, 6  # the change comes at step K; the run ends after TOTAL committed steps
GLOBAL_BATCH, MICRO, SAMPLES, SEED = 12, 2, 96, 5
LR, WD = 1e-2, 0.1
WORLD, VICTIM = 3, 2  # the victim is the last rank: the survivors keep their ranks; a joiner is node 2
# (ZeRO stage, event, precision)
LIVE = [(2, "KILL", "fp32"), (2, "STOP", "fp32"), (1, "STOP", "fp32"), (3, "KILL", "fp32"), (2, "KILL", "bf16")]
JOIN = (2, "JOIN", "fp32")  # 2 -> 3: a fresh process gets its shards from its peers
JOIN_LOST = (2, "JOINLOST", "fp32")  # 2 -> 3 named, the joiner never arrives -> round 2 at 2 again
JOIN_FROZEN = (2, "JOINSTOP", "fp32")  # 2 -> 3, the joiner freezes in round 1's build -> round 2 at 2 again
LOSE2 = (2, "KILL2", "fp32")  # ranks 1 and 2 killed: rank 1's copy was on rank 2, a fallback for rank 0
AFTER_GATE = (2, "GATEKILL", "fp32")  # the victim killed after step K's commit gate, before the attempt ends
CASES = [*LIVE, JOIN, JOIN_LOST, JOIN_FROZEN, LOSE2, AFTER_GATE]
JOINS = ("JOIN", "JOINLOST", "JOINSTOP")
ARRIVAL_S = 1.0  # how long the driver lets the two wait for the lost joiner's arrival before it writes round 2
WAIT_S = 60  # how long a joined rank waits at step K for the driver before the case fails
JOINED_AT = K + 2  # JOIN: the step the two switch at (learnt inside step K, at a world of two)


def victims(sig: str) -> list[int]:
    """The ranks lost in a case (``GATEKILL``: SIGKILLed, like ``KILL``)."""
    return {"KILL2": [1, 2], "JOIN": [], "JOINLOST": [], "JOINSTOP": []}.get(sig, [VICTIM])


def case_name(stage: int, sig: str, precision: str) -> str:
    return f"zero{stage}_{sig.lower()}" + ("" if precision == "fp32" else f"_{precision}")


def config() -> Any:
    return config_for("tiny", block_size=16, n_layer=1)


def tokens() -> torch.Tensor:
    """The data set: ``SAMPLES`` rows of ``block_size + 1`` random tokens (inputs, then targets shifted by one)."""
    gen = torch.Generator().manual_seed(SEED)
    cfg = config()
    return torch.randint(0, cfg.vocab_size, (SAMPLES, cfg.block_size + 1), generator=gen)


def loss_of(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))


def sampler_at(rank: int, world: int) -> ElasticSampler:
    return ElasticSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO, rank=rank, world_size=world)


STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def schedule(opt: Any) -> WarmupDecayLR:
    """The run's LR schedule on ``opt``: a linear warmup from LR / 4 over 2 steps, then a decay (each of steps 2 to
    TOTAL - 1 at another rate; a schedule started over at step K would run K at LR / 4)."""
    return WarmupDecayLR(opt, TOTAL + 2, LR / 4, LR, warmup_num_steps=2, warmup_type="linear")


def lr_of(step: int) -> float:
    """The learning rate step ``step`` (from 0) runs at in an uninterrupted run: the schedule's at iteration
    ``step - 1`` (DeepSpeed's counting)."""
    return schedule(torch.optim.SGD([torch.zeros(1)], lr=LR)).lrs_at(step - 1)[0]


@dataclass
class Built:
    """What ``build`` returns: the ZeRO optimizer and its schedule, stepped at the end of each step's attempt (as
    ``EnginePieces.step`` is the last act of a Training step); ``carried`` and ``count_taken_step`` are what
    :class:`LiveTraining` carries across a round change."""

    optimizer: ZeroOptimizer
    scheduler: DeepSpeedSchedule

    def carried(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler}

    def count_taken_step(self) -> None:
        self.scheduler.step()


def builder(stage: int, precision: str, freeze: bool = False) -> Any:
    """``build(group, module=None, sync_module_states=True)``: a fresh tiny GPT (or ``module``, a survivor's own:
    LiveTraining's ``rebuild``), its ZeRO optimizer of ``stage`` on ``group`` and the schedule on it (``freeze``: the
    process SIGSTOPs itself first, its group formed: a node frozen in the round's build). ``sync_module_states``: the
    loop's False where a member holds state — no broadcast of the module, the reshard writes it whole (a joiner's
    fresh model is seeded by rank, so anything of it left unwritten would show)."""

    def build(group: Any, module: Any = None, sync_module_states: bool = True) -> Built:
        if freeze:
            os.kill(os.getpid(), signal.SIGSTOP)
        if module is None:
            torch.manual_seed(dist.get_rank(group))
            module = GPT(config())
        options = {"precision": precision, "process_group": group, "sync_module_states": sync_module_states}
        opt = STAGES[stage](module, torch.optim.AdamW, lr=LR, weight_decay=WD, **options)
        return Built(opt, schedule(opt))

    return build


def round_file(out: Path, rank: int) -> str:
    return f"{out}.round{rank}.json"


def save_at_k(live: LiveTraining, out: Path) -> None:
    """Every rank's shards gathered (collective), saved by rank 0: the state at the start of step K."""
    at_k = full_state(live.opt)
    if live.rank == 0:
        torch.save(at_k, f"{out}.at_k.pt")


def at_step_k(attempt: Any, live: LiveTraining, out: Path, sig: str) -> None:
    """Inside step K of round 0: the state saved; the victims signal themselves, or (``JOIN``) every rank waits until
    the driver says go (no ``attempt.check()``: a join takes no step's attempt)."""
    save_at_k(live, out)
    if live.rank in victims(sig) and sig != "GATEKILL":
        os.kill(os.getpid(), getattr(signal, f"SIG{sig.rstrip('2')}"))
    if sig == "JOIN":
        Path(f"{out}.waiting{live.rank}").touch()
        wait_files([Path(f"{out}.go")], [], WAIT_S)


def between_steps(live: LiveTraining, out: Path) -> None:
    """``JOINLOST``/``JOINSTOP``, before step K of round 0: the state saved, then a bounded wait between the steps
    until a new round was entered there (``bounded`` says False)."""
    save_at_k(live, out)
    Path(f"{out}.waiting{live.rank}").touch()
    deadline = time.monotonic() + WAIT_S
    while live.bounded(lambda: time.sleep(0.01)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new round within {WAIT_S} s")


def after_the_gate(attempt: Any, live: LiveTraining) -> None:
    """``GATEKILL``, step K of round 0, after the optimizer step (its commit gate passed on every member): the victim
    SIGKILLs itself, the others wait in the attempt until round 1 leaves it — the step was committed everywhere, the
    reshard counts it done, and the attempt reports it committed."""
    if live.rank in victims("GATEKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        attempt.check()
        time.sleep(0.01)
    raise TimeoutError(f"no round 1 within {WAIT_S} s")


def train(rank: int, out: Path, sig: str, stage: int, precision: str) -> None:
    env = {ROUND_FILE_ENV: round_file(out, rank), "LOCAL_RANK": "0"}
    freeze = sig == "JOINSTOP" and rank == VICTIM  # the joiner
    build = builder(stage, precision, freeze)
    live = LiveTraining.from_agent(
        build, sampler=sampler_at(0, 1), env=env, nodes=lambda n: list(range(n)), rebuild=build
    )
    data, reported, lrs, models, attempts = tokens(), [], [], set(), 0
    for attempt in live.steps(TOTAL):
        if sig in ("JOINLOST", "JOINSTOP") and live.step == K and live.round.number == 0:
            between_steps(live, out)
        models.add(id(attempt.model))
        with attempt:
            attempts += 1
            lr = float(attempt.opt.param_groups[0]["lr"])
            at_k = attempt.step == K and live.round.number == 0
            if at_k and sig not in ("JOINLOST", "JOINSTOP"):
                at_step_k(attempt, live, out, sig)
            batches = attempt.micro_batches
            for idx in batches:
                (loss_of(attempt.model, data[idx]) / len(batches)).backward()
            attempt.opt.step()
            attempt.opt.zero_grad()
            if at_k and sig == "GATEKILL":
                after_the_gate(attempt, live)
            live.built.scheduler.step()
        if attempt.committed:  # what a user's post-commit code sees: every committed step once
            reported.append(attempt.number)
            lrs.append(lr)
    events = [
        {"round": e.round.number, **{k: getattr(e, k) for k in ("left_at", "ready_at", "step", "first_step_at")}}
        for e in live.events
    ]
    result = {"pid": os.getpid(), "record": live.record, "events": events, "world": live.opt.world_size}
    result["reported"], result["lrs"], result["models"] = reported, lrs, len(models)
    result["attempts"] = attempts
    final = live.opt.full_state_dict()  # collective over the last round's group
    if live.rank == 0:
        torch.save(final, f"{out}.final.pt")
    live.close()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))


def wait_stopped(pid: int, timeout: float = 60) -> None:
    """Until ``pid`` is in the stopped state (its SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} never stopped")
        time.sleep(0.005)


def wait_files(paths: list[Path], pids: list[int], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            kill_all(pids)
            raise TimeoutError(f"waiting for {paths}; the case's ranks were killed")
        time.sleep(0.01)


def wait_keys(store: Any, keys: list[str], pids: list[int], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            kill_all(pids)
            raise TimeoutError(f"waiting for {keys}; the case's ranks were killed")
        time.sleep(0.01)


def kill_all(pids: list[int]) -> None:
    for other in pids:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(other, signal.SIGKILL)
            os.waitpid(other, 0)


def exit_code(pid: int, pids: list[int], timeout: float = 120) -> int:
    """``pid``'s exit code; after ``timeout`` every process of ``pids`` still there is killed (a hung case fails, its
    ranks do not outlive the driver)."""
    deadline = time.monotonic() + timeout
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            kill_all(pids)
            raise TimeoutError(f"pid {pid} still running after {timeout} s; the case's ranks were killed")
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(status[1])


def child(rank: int, out: Path, sig: str, stage: int, precision: str) -> int:
    try:
        train(rank, out, sig, stage, precision)
        return 0
    except LiveError as err:  # for the restart path: the reason, and an exit code of its own
        Path(f"{out}.rank{rank}.live_error").write_text(f"{type(err).__name__}: {err}")
        return 3
    except BaseException:
        Path(f"{out}.rank{rank}.err").write_text(traceback.format_exc())
        return 1


def fork_rank(rank: int, out: Path, case: tuple[int, str, str]) -> int:
    stage, sig, precision = case
    pid = os.fork()
    if pid == 0:
        # an abandoned group keeps a lost member and a thread in its collective: no teardown (the interpreter's
        # exit would destroy the groups this process kept referenced), leave at once
        os._exit(child(rank, out, sig, stage, precision))
    return pid


def write_rounds(out: Path, number: int, members: list[int], store: StoreAddress) -> None:
    """Round ``number`` of ``members`` (old rank ids, in new-rank order) into each member's file (one node each)."""
    for new, r in enumerate(members):
        write_round(round_file(out, r), NodeRound(number, len(members), ((0, new),), store, f"round{number}/"))


def run_case(case: tuple[int, str, str], out: Path) -> None:
    """Play the agent for one case (see the module); writes ``OUT.harness.json``."""
    sig = case[1]
    port = free_port()
    store = StoreAddress("127.0.0.1", port, rank0_hosts=False)
    first = [0, 1] if sig in JOINS else list(range(WORLD))
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    write_rounds(out, 0, first, store)
    pids = [fork_rank(r, out, case) for r in first]
    lost = victims(sig)
    survivors = [r for r in first if r not in lost]
    codes = dict.fromkeys(range(WORLD), 0)
    if sig == "JOIN":  # the joiner first, ready before the two learn of round 1 (both inside step K)
        wait_files([Path(f"{out}.waiting{r}") for r in first], pids)
        survivors = [*first, VICTIM]
        write_round(round_file(out, VICTIM), NodeRound(1, 3, ((0, 0),), store, "round1/"))  # as rank 0
        pids.append(fork_rank(VICTIM, out, case))
        wait_keys(dist.PrefixStore("round1/", server), [ready_key(0)], pids)
        write_rounds(out, 1, [VICTIM, *first], store)
        Path(f"{out}.go").touch()
    if sig == "JOINLOST":  # round 1 names a joiner that never comes; the agents' next round drops it
        wait_files([Path(f"{out}.waiting{r}") for r in first], pids)
        write_rounds(out, 1, [*first, VICTIM], store)
        time.sleep(ARRIVAL_S)
        survivors = first
        write_rounds(out, 2, survivors, store)
    if sig == "JOINSTOP":  # the joiner arrives, then freezes in its build; the agents' next round drops it
        wait_files([Path(f"{out}.waiting{r}") for r in first], pids)
        write_rounds(out, 1, [*first, VICTIM], store)
        pids.append(fork_rank(VICTIM, out, case))
        wait_stopped(pids[VICTIM])
        time.sleep(ARRIVAL_S)  # the two are in their builds' broadcast by now (a late one finds round 2 at once)
        survivors = first
        write_rounds(out, 2, survivors, store)
    for r in lost:
        if sig == "STOP":
            wait_stopped(pids[r])
        else:
            codes[r] = exit_code(pids[r], pids)
    if sig not in JOINS:
        write_rounds(out, 1, survivors, store)
    announced = time.monotonic()
    codes.update({r: exit_code(pids[r], pids) for r in survivors})
    for r in lost if sig == "STOP" else [VICTIM] if sig == "JOINSTOP" else []:
        os.kill(pids[r], signal.SIGKILL)
        codes[r] = exit_code(pids[r], pids)
    report = {"pids": pids, "codes": [codes[r] for r in range(WORLD)], "announced": announced}
    Path(f"{out}.harness.json").write_text(json.dumps(report))
    del server


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    only = set(sys.argv[2:])  # case names to run (default: all)
    for case in CASES:
        if not only or case_name(*case) in only:
            run_case(case, Path(f"{sys.argv[1]}.{case_name(*case)}"))
