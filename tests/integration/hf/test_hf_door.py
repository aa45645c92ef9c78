"""The HF ``Trainer`` front door (``elasticzero.integrations.hf.ZeroTrainer``) for real: ``elasticzero-run`` starts
``hf_door_worker.py`` on 2 CPU ranks (plain DDP in fp32 and float64, ZeroTrainer at stages 1-3, the HF docs'
``ds_config`` with ``"auto"`` values, a ``save_model`` export reloaded by ``from_pretrained``), then on 1 rank
(ZeroTrainer at stage 3 resumes the stage-2 run's ``checkpoint-2``: a reshard 2 → 1 ranks and stage 2 → 3).

Two launches in all (3 processes). Losses and gradient norms are compared by the ``ez_numerics`` rule: within what
rounding moved the plain DDP fp32 run off the float64 run of the same ``Trainer`` (``error_ratio`` ≤ 1).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ez_numerics import U32, error_ratio
from ez_testing import free_port, pythonpath_with_tests, require

RUN = str(Path(sys.executable).parent / "elasticzero-run")
WORKER = str(Path(__file__).with_name("hf_door_worker.py"))
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

Report = dict[str, Any]


def _launch(out: Path, nproc: int, phase: str) -> list[Report]:
    """One ``elasticzero-run`` job of the worker; every rank's report (the job must exit 0)."""
    job = f"ezt-hfdoor-{secrets.token_hex(4)}"
    argv = [RUN, "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job, "--max-restarts", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env["PYTHONPATH"] = pythonpath_with_tests(Path(__file__).parent)
    try:
        done = subprocess.run(
            [*argv, WORKER, str(out), phase], env=env, capture_output=True, text=True, timeout=600, check=False
        )
    except subprocess.TimeoutExpired:
        kill = [RUN, "--kill-job", job, "--grace", "2"]
        subprocess.run(kill, capture_output=True, timeout=60, check=False)
        raise
    reports = [Path(out, f"report.{phase}.rank{r}.json") for r in range(nproc)]
    errors = [json.loads(p.read_text()).get("error") for p in reports if p.exists()]
    assert done.returncode == 0, "\n".join(e for e in errors if e) or done.stderr[-4000:]
    return [json.loads(p.read_text()) for p in reports]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Report]:
    for name in ("transformers", "accelerate"):
        require(importlib.util.find_spec(name) is not None, f"{name} missing: pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("hfdoor")
    train = _launch(out, 2, "train")
    resume = _launch(out, 1, "resume")
    return {"train": train[0], "train1": train[1], "resume": resume[0], "out": {"dir": str(out)}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_trains_like_the_trainer_s_ddp_run(runs: dict[str, Report], stage: int) -> None:
    r = runs["train"]
    assert r[f"s{stage}_stage"] == f"ZeroStage{stage}"
    assert r[f"s{stage}_ddp_wrapped"] is False  # marked prepared: accelerate added no DDP around it
    assert len(r[f"s{stage}_losses"]) == len(r["ddp_losses"]) == 4
    # the Trainer logs every run's loss through its fp32 sum, the float64 truth's too: two stores (ez_numerics)
    assert error_ratio(r[f"s{stage}_losses"], r["ddp_losses"], r["truth_losses"], fp32_stores=2) <= 1
    # the engine's global norm over every rank's shards, logged as the Trainer logs DDP's (every step clipped at 0.5)
    assert error_ratio(r[f"s{stage}_norms"], r["ddp_norms"], r["truth_norms"]) <= 1
    assert min(r[f"s{stage}_norms"]) > 0.5


def test_evaluate_runs_on_the_stage_3_model(runs: dict[str, Report]) -> None:
    r = runs["train"]
    assert error_ratio([r["s3_eval"]], [r["ddp_eval"]], [r["truth_eval"]]) <= 1


def test_every_rank_logs_the_same_curve(runs: dict[str, Report]) -> None:
    for key in ("s1_losses", "s2_losses", "s3_losses"):
        assert runs["train"][key] == runs["train1"][key]


def test_a_world_2_checkpoint_resumes_at_world_1_and_stage_3(runs: dict[str, Report]) -> None:
    r, resumed = runs["train"], runs["resume"]
    assert resumed["resumed_world"] == 1 and resumed["resumed_steps"] == [3, 4]
    # steps 3 and 4 after the resume: the uninterrupted runs' steps 3 and 4 by the same rule
    assert error_ratio(resumed["resumed_losses"], r["ddp_losses"][2:], r["truth_losses"][2:], fp32_stores=2) <= 1
    assert error_ratio(resumed["resumed_norms"], r["ddp_norms"][2:], r["truth_norms"][2:]) <= 1


def test_the_newest_complete_checkpoint_is_the_restart_s(runs: dict[str, Report]) -> None:
    assert runs["train"]["s2_last_checkpoint"] == str(Path(runs["out"]["dir"], "s2", "checkpoint-4"))
    assert (Path(runs["out"]["dir"], "s2", "checkpoint-2", "elasticzero", "latest")).is_file()


def test_save_model_loads_with_from_pretrained_and_gives_the_same_logits(runs: dict[str, Report]) -> None:
    r = runs["train"]
    assert r["export_dtype"] == "torch.float32"  # the fp32 masters, gathered from the stage-3 shards
    # the same fp32 math on the same weights in one process: equal bit for bit where the kernels match; a kernel
    # summing in another order for differently laid-out storage moves at most the last bits of each dot product
    # (length <= 64 here), so 64 units of fp32 roundoff at the logits' scale
    assert r["export_logits_maxdiff"] <= 64 * U32 * r["export_logits_scale"], r["export_logits_maxdiff"]


def test_the_hf_docs_ds_config_with_auto_values_runs(runs: dict[str, Report]) -> None:
    r = runs["train"]
    assert r["ds_filled"] == {
        "stage": 2,
        "lr": 1e-3,
        "betas": [0.9, 0.999],
        "weight_decay": 0.01,
        "clip": 0.5,
        "train_batch_size": 4,
        "micro": 2,
        "scheduler": "WarmupLR",
        "warmup_max_lr": 1e-3,
        "offload": True,
    }
    assert len(r["ds_losses"]) == 2 and all(math.isfinite(x) for x in r["ds_losses"])
    # the first step's loss is the initial model's on the first batch: the DDP run's first loss
    assert error_ratio(r["ds_losses"][:1], r["ddp_losses"][:1], r["truth_losses"][:1]) <= 1
