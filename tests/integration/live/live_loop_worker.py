"""One rank of test_live_loop: ``live_loop_worker.py RANK WORLD STORE_PORT OUT VICTIM SIGNAL`` trains the tiny GPT
with ZeRO-2 in :class:`~elasticzero.live.LiveTraining` over the harness's store (hosted outside the ranks, as the
agent hosts it). At step ``K`` rank ``VICTIM`` saves the whole state (every rank's shards, gathered: the start of the
reference run) and then sends itself ``SIGNAL`` (``KILL`` or ``STOP``). The survivors write ``OUT.rank<r>.json``: their
pid, the sample record (every committed step), the reconfigurations (monotonic times) and, on rank 0, the final
parameters (``OUT.final.pt``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))  # the tiny GPT
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))  # full_state

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ckpt_model import full_state

from elasticzero.data.sampler import ElasticSampler
from elasticzero.engine.zero.stage2 import ZeroStage2
from elasticzero.live import LiveTraining, Round, RoundSource
from gpt import GPT, config_for

K, TOTAL = 3, 6  # the failure comes at step K; the run ends after TOTAL committed steps
GLOBAL_BATCH, MICRO, SAMPLES, SEED = 12, 2, 96, 5
LR, WD = 1e-2, 0.1


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


def build(group: Any) -> ZeroStage2:
    torch.manual_seed(0)
    return ZeroStage2(GPT(config()), torch.optim.AdamW, lr=LR, weight_decay=WD, process_group=group)


def train(rank: int, world: int, port: int, out: Path, victim: int, sig: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("round0/", store), rank=rank, world_size=world)
    sampler = ElasticSampler(
        SAMPLES, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO, rank=rank, world_size=world
    )
    first = Round(0, tuple((r, r) for r in range(world)), "round0/")
    live = LiveTraining(build, sampler=sampler, source=RoundSource(store), first=first, nodes=lambda n: list(range(n)))
    data = tokens()
    for attempt in live.steps(TOTAL):
        with attempt:
            if attempt.step == K and live.round.number == 0:
                at_k = full_state(attempt.opt)  # every rank's shards (collective), before the failure
                if rank == 0:
                    torch.save(at_k, f"{out}.at_k.pt")
                if rank == victim:
                    os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
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
    if live.rank == 0:
        torch.save({k: v.detach().clone() for k, v in live.model.state_dict().items()}, f"{out}.final.pt")
    live.close()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    r, w, p, o, v, s = sys.argv[1:]
    try:
        train(int(r), int(w), int(p), Path(o), int(v), s)
    except BaseException:
        Path(f"{o}.rank{r}.err").write_text(traceback.format_exc())
        os._exit(1)
    # The first round's group has a lost member and a thread still in its abandoned collective: no teardown of it
    # (destroy_process_group would join that thread), leave at once.
    os._exit(0)
