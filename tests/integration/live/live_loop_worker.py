"""Driver of test_live_loop: ``live_loop_worker.py OUT`` runs every case of :data:`CASES` (torch imported once, here):
it forks 3 ranks that train the tiny GPT at ZeRO-``stage`` in :class:`~elasticzero.live.LiveTraining` and stands in
for the agent: it hosts the store (outside the ranks), sees the victim die or stop, announces round 1 of the
survivors and fences the victim. At step ``K`` the victim (rank 2; ranks 1 and 2 in ``KILL2``), after every rank's
shards were gathered and saved (``OUT.<case>.at_k.pt``: the start of the reference run), sends itself the case's
signal. The survivors write ``OUT.<case>.rank<r>.json`` (pid, sample record, reconfigurations with monotonic times);
rank 0 the final parameters (``OUT.<case>.final.pt``); the driver ``OUT.<case>.harness.json`` (pids, exit codes,
when it announced). A rank that ends in a :class:`~elasticzero.live.LiveError` (the restart path) writes it to
``OUT.<case>.rank<r>.live_error`` and exits 3."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
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
from elasticzero.engine.zero.base import ZeroOptimizer
from elasticzero.engine.zero.stage1 import ZeroStage1
from elasticzero.engine.zero.stage2 import ZeroStage2
from elasticzero.engine.zero.stage3 import ZeroStage3
from elasticzero.live import LiveError, LiveTraining, Round, RoundSource, announce
from ez_testing import free_port
from gpt import GPT, config_for

K, TOTAL = 3, 6  # the failure comes at step K; the run ends after TOTAL committed steps
GLOBAL_BATCH, MICRO, SAMPLES, SEED = 12, 2, 96, 5
LR, WD = 1e-2, 0.1
WORLD, VICTIM = 3, 2  # the victim is the last rank: the survivors keep their ranks
LIVE = [(2, "KILL"), (2, "STOP"), (1, "STOP"), (3, "KILL")]  # (ZeRO stage, signal)
LOSE2 = (2, "KILL2")  # ranks 1 and 2 killed: rank 1's copy was on rank 2, a fallback for rank 0
CASES = [*LIVE, LOSE2]


def victims(sig: str) -> list[int]:
    return [1, 2] if sig == "KILL2" else [VICTIM]


def case_name(stage: int, sig: str) -> str:
    return f"zero{stage}_{sig.lower()}"


def config() -> Any:
    return config_for("tiny", block_size=16, n_layer=1)


def tokens() -> torch.Tensor:
    """The data set: ``SAMPLES`` rows of ``block_size + 1`` random tokens (inputs, then targets shifted by one)."""
    gen = torch.Generator().manual_seed(SEED)
    cfg = config()
    return torch.randint(0, cfg.vocab_size, (SAMPLES, cfg.block_size + 1), generator=gen)


def loss_of(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def builder(stage: int) -> Any:
    """``build(group)``: a fresh tiny GPT and its ZeRO optimizer of ``stage`` on ``group``."""

    def build(group: Any) -> ZeroOptimizer:
        torch.manual_seed(0)
        return STAGES[stage](GPT(config()), torch.optim.AdamW, lr=LR, weight_decay=WD, process_group=group)

    return build


def train(rank: int, world: int, port: int, out: Path, sig: str, stage: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("round0/", store), rank=rank, world_size=world)
    sampler = ElasticSampler(
        SAMPLES, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO, rank=rank, world_size=world
    )
    first = Round(0, tuple((r, r) for r in range(world)), "round0/")
    live = LiveTraining(
        builder(stage), sampler=sampler, source=RoundSource(store), first=first, nodes=lambda n: list(range(n))
    )
    data = tokens()
    for attempt in live.steps(TOTAL):
        with attempt:
            if attempt.step == K and live.round.number == 0:
                at_k = full_state(attempt.opt)  # every rank's shards (collective), before the failure
                if rank == 0:
                    torch.save(at_k, f"{out}.at_k.pt")
                if rank in victims(sig):
                    os.kill(os.getpid(), getattr(signal, f"SIG{sig.rstrip('2')}"))
            batches = attempt.micro_batches
            for idx in batches:
                (loss_of(attempt.model, data[idx]) / len(batches)).backward()
            attempt.opt.step()
            attempt.opt.zero_grad()
    events = [
        {"round": e.round.number, **{k: getattr(e, k) for k in ("left_at", "ready_at", "step", "first_step_at")}}
        for e in live.events
    ]
    result = {"pid": os.getpid(), "record": live.record, "events": events, "world": live.opt.world_size}
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


def exit_code(pid: int, pids: list[int], timeout: float = 120) -> int:
    """``pid``'s exit code; after ``timeout`` every process of ``pids`` still there is killed (a hung case fails, its
    ranks do not outlive the driver)."""
    deadline = time.monotonic() + timeout
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            for other in pids:
                with contextlib.suppress(ChildProcessError, ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
                    os.waitpid(other, 0)
            raise TimeoutError(f"pid {pid} still running after {timeout} s; the case's ranks were killed")
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(status[1])


def child(rank: int, port: int, out: Path, sig: str, stage: int) -> int:
    try:
        train(rank, WORLD, port, out, sig, stage)
        return 0
    except LiveError as err:  # for the restart path: the reason, and an exit code of its own
        Path(f"{out}.rank{rank}.live_error").write_text(f"{type(err).__name__}: {err}")
        return 3
    except BaseException:
        Path(f"{out}.rank{rank}.err").write_text(traceback.format_exc())
        return 1


def run_case(stage: int, sig: str, out: Path) -> None:
    """Stand in for the agent: fork the ranks, host the store, see the victim die or stop, announce round 1 of the
    survivors, fence the victim (killed, never resumed) once they are done; writes ``OUT.harness.json``."""
    port, pids = free_port(), []
    for r in range(WORLD):
        pid = os.fork()
        if pid == 0:
            # the first round's group keeps a lost member and a thread in its abandoned collective: no teardown
            # (destroy_process_group would join that thread), leave at once
            os._exit(child(r, port, out, sig, stage))
        pids.append(pid)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=True, wait_for_workers=False)
    lost = victims(sig)
    survivors = [r for r in range(WORLD) if r not in lost]
    codes = dict.fromkeys(range(WORLD), 0)
    for r in lost:
        if sig == "STOP":
            wait_stopped(pids[r])
        else:
            codes[r] = exit_code(pids[r], pids)
    announce(store, Round(1, tuple((r, new) for new, r in enumerate(survivors)), "round1/"))
    announced = time.monotonic()
    codes.update({r: exit_code(pids[r], pids) for r in survivors})
    for r in lost if sig == "STOP" else []:
        os.kill(pids[r], signal.SIGKILL)
        codes[r] = exit_code(pids[r], pids)
    report = {"pids": pids, "codes": [codes[r] for r in range(WORLD)], "announced": announced}
    Path(f"{out}.harness.json").write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for case in CASES:
        run_case(*case, Path(f"{sys.argv[1]}.{case_name(*case)}"))
