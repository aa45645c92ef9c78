"""Live reconfiguration with real gloo ranks (``live_loop_worker.py``): 3 ranks train the tiny GPT at ZeRO-1/2/3 in
:class:`~elasticzero.live.LiveTraining`; at step K rank 2 is SIGKILLed or SIGSTOPped. This test stands in for the
agent: it hosts the store, sees the rank die or stop, and announces round 1 of the two survivors. Then:

- the survivors are the same processes (pids unchanged) and went through one reconfiguration, resuming at step K;
- no committed step is redone: each survivor's sample record holds every step once; from step K on, the two
  survivors' samples are exactly the global batch of that step (the global batch kept at world 2), before it their
  shares are disjoint parts of it;
- the final parameters equal plain torch continued from the step-K state (gathered from all three ranks before the
  failure) on the same global batches, within ``ez_numerics``' rule: the error against the same continuation in
  float64 is at most 3x plain fp32 torch's own (a world-2 ZeRO run differs from plain torch by rounding only).

And when ranks 1 and 2 are killed at once (rank 1's copy was on rank 2), rank 0 leaves with one clear error for the
restart path (``ReshardFallback``). It prints the time from the announcement to the first completed step at the new
world (the figure for the note).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from live_loop_worker import (
    GLOBAL_BATCH,
    LIVE,
    LOSE2,
    LR,
    SAMPLES,
    TOTAL,
    VICTIM,
    WD,
    K,
    case_name,
    config,
    loss_of,
    tokens,
)

from elasticzero.data.sampler import epoch_order
from ez_numerics import error_ratio
from gpt import GPT

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case run once by the driver (one process imports torch and forks each case's ranks)."""
    out = tmp_path_factory.mktemp("live") / "live"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, str(HERE / "live_loop_worker.py"), str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


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


@pytest.mark.parametrize(("stage", "sig"), LIVE)
def test_live_loop(runs: Path, stage: int, sig: str) -> None:
    out = Path(f"{runs}.{case_name(stage, sig)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    errors = [Path(f"{out}.rank{r}.err") for r in range(VICTIM)]
    assert harness["codes"] == [0] * VICTIM + [-signal.SIGKILL], [e.read_text() for e in errors if e.exists()]
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(VICTIM)]
    assert [res["pid"] for res in results] == harness["pids"][:VICTIM]  # the survivors kept their processes
    assert [res["world"] for res in results] == [VICTIM] * VICTIM
    for res in results:
        assert [(e["round"], e["step"]) for e in res["events"]] == [(1, K)], res["events"]
    assert record_problems([res["record"] for res in results]) == []
    start = torch.load(f"{out}.at_k.pt")
    got = torch.load(f"{out}.final.pt")
    truth = continue_plainly({k: v.double() for k, v in start.items()}, torch.float64)
    ref = continue_plainly(start, torch.float32)
    ratio = error_ratio(got, ref, truth)
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the fp32 rounding scale (ez_numerics rule)"
    left = max(e["left_at"] for res in results for e in res["events"]) - harness["announced"]
    first = max(e["first_step_at"] for res in results for e in res["events"]) - harness["announced"]
    print(
        f"ZeRO-{stage} SIG{sig}: announcement -> old group left {left:.3f} s, -> first step at world 2 {first:.3f} s "
        f"(error ratio {ratio:.3g})"
    )


def test_both_copies_lost_is_one_clear_error_for_the_restart_path(runs: Path) -> None:
    """Ranks 1 and 2 killed at once: rank 1's copy was on rank 2, so rank 0 cannot reshard in memory; it leaves with
    ``ReshardFallback`` (exit 3 here), naming what is lost and the disk checkpoint."""
    out = Path(f"{runs}.{case_name(*LOSE2)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    assert harness["codes"] == [3, -signal.SIGKILL, -signal.SIGKILL], Path(f"{out}.rank0.err").read_text()
    said = Path(f"{out}.rank0.live_error").read_text()
    assert said.startswith("ReshardFallback: ") and "both copies of the state of old rank(s) [1] are lost" in said
    assert "disk checkpoint" in said
