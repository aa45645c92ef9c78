"""Live reconfiguration with real gloo ranks (``live_loop_worker.py``): 3 ranks train the tiny GPT at ZeRO-2 in
:class:`~elasticzero.live.LiveTraining`; at step K rank 2 is SIGKILLed or SIGSTOPped. This test stands in for the
agent: it hosts the store, sees the rank die or stop, and announces round 1 of the two survivors. Then:

- the survivors are the same processes (pids unchanged) and went through one reconfiguration, resuming at step K;
- no committed step is redone: each survivor's sample record holds every step once; from step K on, the two
  survivors' samples are exactly the global batch of that step (the global batch kept at world 2), before it their
  shares are disjoint parts of it;
- the final parameters equal plain torch continued from the step-K state (gathered from all three ranks before the
  failure) on the same global batches, within ``ez_numerics``' rule: the error against the same continuation in
  float64 is at most 3x plain fp32 torch's own (a world-2 ZeRO run differs from plain torch by rounding only).

It prints the time from the announcement to the first completed step at the new world (the figure for the note).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from live_loop_worker import GLOBAL_BATCH, LR, SAMPLES, TOTAL, WD, K, config, loss_of, tokens

from elasticzero.data.sampler import epoch_order
from elasticzero.live import Round, announce
from ez_numerics import error_ratio
from ez_testing import free_port
from gpt import GPT

HERE = Path(__file__).parent
WORLD, VICTIM = 3, 2


def wait_stopped(pid: int, timeout: float = 60) -> None:
    """Until ``pid`` is in the stopped state (SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"rank {VICTIM} never stopped"
        time.sleep(0.01)


def run_job(tmp_path: Path, sig: str) -> tuple[list[subprocess.Popen[bytes]], float, Path]:
    """Start the 3 ranks, wait for the victim's signal, announce round 1; returns the processes, when it announced
    (monotonic, the clock the workers use) and the output stem."""
    port, out = free_port(), tmp_path / "live"
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, str(HERE / "live_loop_worker.py")]
    procs = [
        subprocess.Popen([*argv, str(r), str(WORLD), str(port), str(out), str(VICTIM), sig], env=env)
        for r in range(WORLD)
    ]
    victim = procs[VICTIM]
    if sig == "KILL":
        assert victim.wait(timeout=120) == -signal.SIGKILL
    else:
        wait_stopped(victim.pid)
    announce(store, Round(1, ((0, 0), (1, 1)), "round1/"))
    announced = time.monotonic()
    try:
        for p in procs[:VICTIM]:
            assert p.wait(timeout=120) == 0, Path(f"{out}.rank{procs.index(p)}.err").read_text()
    finally:
        for p in procs:  # the agent fences a frozen worker: killed, never resumed
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs, announced, out


def continue_plainly(start: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain torch AdamW from the step-K state (masters, moments, step), steps K..TOTAL-1 on the same global batches
    (the whole global batch's mean loss: what every world size computes), in ``dtype``."""
    model = GPT(config()).to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(start[name].reshape(p.shape))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for name, p in params.items():
        opt.state[p] = {
            "step": start[f"{name}.step"].reshape(()).to(torch.float32),
            "exp_avg": start[f"{name}.exp_avg"].reshape(p.shape).to(dtype),
            "exp_avg_sq": start[f"{name}.exp_avg_sq"].reshape(p.shape).to(dtype),
        }
    data, order = tokens(), epoch_order(SAMPLES, 0, 0)
    for step in range(K, TOTAL):
        loss_of(model, data[order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in params.items()}


def record_problems(records: list[list[Any]]) -> list[str]:
    """Every step committed once per survivor; from step K the survivors' samples are the step's global batch."""
    order, bad = epoch_order(SAMPLES, 0, 0).tolist(), []
    for r, rec in enumerate(records):
        if [s for s, _ in rec] != list(range(TOTAL)):
            bad.append(f"rank {r} committed steps {[s for s, _ in rec]}")
    for step in range(TOTAL):
        want = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        got = [i for rec in records for s, idx in rec if s == step for i in idx]
        whole = sorted(got) == sorted(want) if step >= K else set(got) <= set(want) and len(set(got)) == len(got)
        if not whole:
            bad.append(f"step {step}: samples {got} are not the global batch {want}")
    return bad


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_live_loop_zero2(tmp_path: Path, sig: str) -> None:
    procs, announced, out = run_job(tmp_path, sig)
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(VICTIM)]
    assert [res["pid"] for res in results] == [p.pid for p in procs[:VICTIM]]
    assert [res["world"] for res in results] == [2, 2]
    for res in results:
        assert [(e["round"], e["step"]) for e in res["events"]] == [(1, K)], res["events"]
    assert record_problems([res["record"] for res in results]) == []
    start = torch.load(f"{out}.at_k.pt")
    got = torch.load(f"{out}.final.pt")
    truth = continue_plainly({k: v.double() for k, v in start.items()}, torch.float64)
    ref = continue_plainly(start, torch.float32)
    ratio = error_ratio(got, ref, truth)
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the fp32 rounding scale (ez_numerics rule)"
    first = max(e["first_step_at"] for res in results for e in res["events"])
    left = max(e["left_at"] for res in results for e in res["events"])
    print(
        f"SIG{sig}: announcement -> left the old group {left - announced:.3f} s, "
        f"-> first step at world 2 {first - announced:.3f} s"
    )
