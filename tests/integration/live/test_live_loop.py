"""Live reconfiguration with real gloo ranks (``live_loop_worker.py``): each rank a node with its own round file,
trains the tiny GPT at ZeRO-1/2/3 in :meth:`LiveTraining.from_agent <elasticzero.live.LiveTraining.from_agent>`;
the driver plays the agent (hosts the store, writes the round files). At step K rank 2 of 3 is SIGKILLed or
SIGSTOPped (fp32; one bf16 case), or a fresh third process joins two. Then:

- the survivors are the same processes (pids unchanged) and went through one reconfiguration, resuming at step K;
  at fp32 stages 1/2 they trained one model object throughout (``rebuild``: the model kept, the reshard into it);
  a joiner starts in round 1 at step K with its shards from its peers (no checkpoint exists);
- no committed step is redone: each rank's sample record holds every step it trained once (a joiner's from K); the
  samples of a step over all ranks are exactly its global batch from step K on (the global batch kept at the new
  world), disjoint parts of it before;
- every step ran at the learning rate of an uninterrupted run (a WarmupDecayLR schedule, carried to the new round's
  optimizers from a survivor — a joiner's too — not started over);
- the final parameters equal plain torch continued from the step-K state (gathered from all ranks before the change)
  on the same global batches, within ``ez_numerics``' rule: the error against the same continuation in float64 is at
  most 3x that of the reference in the run's precision (fp32: plain torch; bf16: each rank's micro-batches forward
  and backward on a bf16 copy of the fp32 masters, the gradients summed in fp32 — where a bf16 ZeRO run rounds).

And when ranks 1 and 2 are killed at once (rank 1's copy was on rank 2), rank 0 leaves with one clear error for the
restart path (``ReshardFallback``). It prints the time from the round file's update to the first completed step at
the new world (the figure for the note).
"""

from __future__ import annotations

import copy
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from live_loop_worker import (
    AFTER_GATE,
    GLOBAL_BATCH,
    JOIN,
    JOIN_FROZEN,
    JOIN_LOST,
    JOINED_AT,
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
    lr_of,
    sampler_at,
    tokens,
)

from elasticzero.data.sampler import epoch_order
from ez_numerics import error_ratio
from ez_testing import run_driver
from gpt import GPT

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case run once by the driver (one process imports torch and forks each case's ranks)."""
    out = tmp_path_factory.mktemp("live") / "live"
    run_driver(HERE / "live_loop_worker.py", out)
    return out


def continue_plainly(start: dict[str, torch.Tensor], dtype: torch.dtype, ranks: int = 0) -> dict[str, torch.Tensor]:
    """Plain torch AdamW from the step-K state (masters, moments, step), steps K..TOTAL-1 on the same global batches at
    the schedule's learning rates, in ``dtype``: the whole global batch's mean loss (what every world size computes),
    or with ``ranks`` > 0 the bf16 rounding of a ZeRO run at that world (:func:`bf16_gradient`)."""
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
        if ranks:
            for name, g in bf16_gradient(model, data, step, ranks).items():
                params[name].grad = g
        else:
            loss_of(model, data[order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]]).backward()
        for group in opt.param_groups:
            group["lr"] = lr_of(step)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in params.items()}


def bf16_gradient(model: torch.nn.Module, data: torch.Tensor, step: int, ranks: int) -> dict[str, torch.Tensor]:
    """The gradient of ``step`` as ``ranks`` bf16 ZeRO ranks make it: each micro-batch of each rank (its sampler's)
    runs forward and backward on a bf16 copy of the fp32 model; the gradients are summed in fp32."""
    total: dict[str, torch.Tensor] = {}
    work = copy.deepcopy(model).to(torch.bfloat16)
    for r in range(ranks):
        s = sampler_at(r, ranks)
        s.advance(step * s.accumulation_steps)
        for p in range(s.consumed, s.consumed + GLOBAL_BATCH, s.micro_step):
            work.zero_grad(set_to_none=True)
            (loss_of(work, data[s.micro_batch(s.epoch, p)]) / s.accumulation_steps).backward()
            for name, w in work.named_parameters():
                g = w.grad.float() / ranks  # type: ignore[union-attr]
                total[name] = total[name] + g if name in total else g
    return total


def record_problems(records: list[list[Any]], first: list[int], whole_from: int = K) -> list[str]:
    """Every step rank ``r`` trained (from ``first[r]``) committed once; from step ``whole_from`` the samples of all
    ranks are the step's global batch, before it disjoint parts of it."""
    order, bad = epoch_order(SAMPLES, 0, 0).tolist(), []
    for r, rec in enumerate(records):
        if [s for s, _ in rec] != list(range(first[r], TOTAL)):
            bad.append(f"rank {r} committed steps {[s for s, _ in rec]}")
    for step in range(TOTAL):
        want = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        got = [i for rec in records for s, idx in rec if s == step for i in idx]
        part = set(got) <= set(want) and len(set(got)) == len(got)
        whole = sorted(got) == sorted(want) if step >= whole_from else part
        if not whole:
            bad.append(f"step {step}: samples {got} are not the global batch {want}")
    return bad


def final_ratio(out: Path, precision: str, world: int) -> float:
    """The error ratio (``ez_numerics``) of rank 0's final parameters against plain torch from the step-K state."""
    start = torch.load(f"{out}.at_k.pt")
    got = torch.load(f"{out}.final.pt")
    truth = continue_plainly({k: v.double() for k, v in start.items()}, torch.float64)
    ref = continue_plainly(start, torch.float32, ranks=world if precision == "bf16" else 0)
    return error_ratio(got, ref, truth)


def recovery(results: list[dict[str, Any]], harness: dict[str, Any]) -> tuple[float, float]:
    """Seconds from the round file's update to the last rank leaving the old group, and to the last rank's first
    completed step at the new world."""
    left = max(e["left_at"] for res in results for e in res["events"]) - harness["announced"]
    first = max(e["first_step_at"] for res in results for e in res["events"]) - harness["announced"]
    return left, first


@pytest.mark.parametrize(("stage", "sig", "precision"), LIVE)
def test_live_loop(runs: Path, stage: int, sig: str, precision: str) -> None:
    out = Path(f"{runs}.{case_name(stage, sig, precision)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    errors = [Path(f"{out}.rank{r}.err") for r in range(VICTIM)]
    assert harness["codes"] == [0] * VICTIM + [-signal.SIGKILL], [e.read_text() for e in errors if e.exists()]
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(VICTIM)]
    assert [res["pid"] for res in results] == harness["pids"][:VICTIM]  # the survivors kept their processes
    assert [res["world"] for res in results] == [VICTIM] * VICTIM
    kept = stage in (1, 2) and precision == "fp32"  # ZeroOptimizer.rewrappable: whole fp32 parameters
    assert [res["models"] for res in results] == [1 if kept else 2] * VICTIM  # a survivor trained one model object
    for res in results:
        assert [(e["round"], e["step"]) for e in res["events"]] == [(1, K)], res["events"]
        assert res["reported"] == list(range(TOTAL))  # every committed step reported committed once
        assert res["lrs"] == [lr_of(s) for s in range(TOTAL)]  # the same formula at the same iterations: equal
    assert record_problems([res["record"] for res in results], [0] * VICTIM) == []
    ratio = final_ratio(out, precision, VICTIM)
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the {precision} rounding scale (ez_numerics rule)"
    left, first = recovery(results, harness)
    print(
        f"ZeRO-{stage} {precision} SIG{sig}: announcement -> old group left {left:.3f} s, -> first step at world 2 "
        f"{first:.3f} s (error ratio {ratio:.3g})"
    )


def test_a_fresh_process_joins_with_its_shards_from_its_peers(runs: Path) -> None:
    """Two ranks train; inside step K they learn that a fresh process is ready to join (round 1, world 3) as rank 0:
    they finish that step and the next at world 2 — the switch step they agree on, no attempt left — and switch at
    K + 2. The round's build broadcasts the joiner's fresh module into the two's, whose buffers they hand over while
    the reshard reads their state (copied aside first). The two keep their processes and go through one
    reconfiguration; the joiner (no checkpoint exists anywhere) starts at step K + 2 with the step and the sampler
    position from its peers and its shards resharded to it; the run ends where plain torch does."""
    stage, sig, precision = JOIN
    out = Path(f"{runs}.{case_name(stage, sig, precision)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    errors = [Path(f"{out}.rank{r}.err") for r in range(3)]
    assert harness["codes"] == [0, 0, 0], [e.read_text() for e in errors if e.exists()]
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(3)]
    assert [res["pid"] for res in results] == harness["pids"]  # the two kept theirs; the joiner is the new one
    assert [res["world"] for res in results] == [3, 3, 3]
    assert [res["models"] for res in results] == [1, 1, 1]  # the two kept theirs across the join
    switched = [[(1, JOINED_AT)], [(1, JOINED_AT)], []]
    assert [[(e["round"], e["step"]) for e in res["events"]] for res in results] == switched
    assert [res["attempts"] for res in results] == [TOTAL, TOTAL, TOTAL - JOINED_AT]  # no step left for the join
    assert [res["lrs"] for res in results] == [[lr_of(s) for s in range(f, TOTAL)] for f in (0, 0, JOINED_AT)]
    assert record_problems([res["record"] for res in results], [0, 0, JOINED_AT]) == []
    ratio = final_ratio(out, precision, 3)
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the {precision} rounding scale (ez_numerics rule)"
    _, first = recovery(results[:2], harness)
    print(f"ZeRO-{stage} join 2 -> 3: announcement -> first step at world 3 {first:.3f} s (error ratio {ratio:.3g})")


def test_a_joiner_lost_before_it_arrives_is_left_for_the_next_round(runs: Path) -> None:
    """Round 1 names a joiner that never comes (killed while it started): the two wait for its arrival without a
    bound of their own, polling their round files, and form round 2 (world 2 again) as soon as it is written — not
    after the group's timeout (torch's 30 min for gloo here) in ``init_process_group``. Same processes, every step
    committed once, the parameters of an uninterrupted run."""
    left_for_round_2(runs, JOIN_LOST, "joiner lost before arriving")


def test_a_member_frozen_in_the_round_s_build_is_left_for_the_next_round(runs: Path) -> None:
    """Round 1's joiner arrives, then freezes at the start of its ``build``: the two are in their own builds, in the
    engine's broadcast of the module's state — a collective of a user's code the round's build runs, outside every
    step. The build is bounded like a step's waits: the two leave it when round 2 (world 2 again) is written and train
    on there from the state they held, not after the group's timeout."""
    left_for_round_2(runs, JOIN_FROZEN, "joiner frozen in its build")


def left_for_round_2(runs: Path, case: tuple[int, str, str], what: str) -> None:
    """The two ranks of a join whose joiner never trains formed round 2 (world 2) and trained on (see the callers)."""
    stage, sig, precision = case
    out = Path(f"{runs}.{case_name(stage, sig, precision)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    errors = [Path(f"{out}.rank{r}.err") for r in range(2)]
    assert harness["codes"][:2] == [0, 0], [e.read_text() for e in errors if e.exists()]
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert [res["pid"] for res in results] == harness["pids"][:2] and [res["world"] for res in results] == [2, 2]
    assert [[(e["round"], e["step"]) for e in res["events"]] for res in results] == [[(2, K)], [(2, K)]]
    assert [res["lrs"] for res in results] == [[lr_of(s) for s in range(TOTAL)]] * 2
    assert record_problems([res["record"] for res in results], [0, 0]) == []
    ratio = final_ratio(out, precision, 2)
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the {precision} rounding scale (ez_numerics rule)"
    _, first = recovery(results, harness)
    # the bound is a round-file poll (20 ms) + forming a 2-rank group + one tiny step: 30 s is far above it under any
    # load, and far below the 5 min of the store's wait or gloo's 30 min that an unbounded wait would take
    assert first < 30.0, f"round 2 took {first:.1f} s after its announcement"
    print(f"ZeRO-{stage} {what}: round 2 announced -> first step at world 2 {first:.3f} s")


def test_both_copies_lost_is_one_clear_error_for_the_restart_path(runs: Path) -> None:
    """Ranks 1 and 2 killed at once: rank 1's copy was on rank 2, so rank 0 cannot reshard in memory; it leaves with
    ``ReshardFallback`` (exit 3 here), naming what is lost and the disk checkpoint."""
    out = Path(f"{runs}.{case_name(*LOSE2)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    assert harness["codes"] == [3, -signal.SIGKILL, -signal.SIGKILL], Path(f"{out}.rank0.err").read_text()
    said = Path(f"{out}.rank0.live_error").read_text()
    assert said.startswith("ReshardFallback: ") and "both copies of the state of old rank(s) [1] are lost" in said
    assert "disk checkpoint" in said


def test_a_step_left_after_its_commit_gate_is_reported_committed_once(runs: Path) -> None:
    """The victim is SIGKILLed after step K's optimizer step — its commit gate passed on every member — while the
    survivors are still in step K's attempt. The reshard of round 1 counts step K done (round 1 starts at K + 1), and
    the survivors' attempt at step K reports it committed: a user's post-commit code (a log line, a metric, a counter)
    sees every step once, K too. Same processes, every step recorded once, the parameters of an uninterrupted run."""
    stage, sig, precision = AFTER_GATE
    out = Path(f"{runs}.{case_name(stage, sig, precision)}")
    harness = json.loads(Path(f"{out}.harness.json").read_text())
    errors = [Path(f"{out}.rank{r}.err") for r in range(VICTIM)]
    assert harness["codes"] == [0] * VICTIM + [-signal.SIGKILL], [e.read_text() for e in errors if e.exists()]
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(VICTIM)]
    assert [res["pid"] for res in results] == harness["pids"][:VICTIM]
    for res in results:
        assert [(e["round"], e["step"]) for e in res["events"]] == [(1, K + 1)], res["events"]
        assert res["reported"] == list(range(TOTAL)), res["reported"]
        assert res["lrs"] == [lr_of(s) for s in range(TOTAL)]  # step K + 1 on: the schedule counted step K
    assert record_problems([res["record"] for res in results], [0] * VICTIM, whole_from=K + 1) == []
    ratio = final_ratio(out, precision, VICTIM)
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the {precision} rounding scale (ez_numerics rule)"
