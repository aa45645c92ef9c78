"""``ElasticZeroStrategy`` for real: two ``elasticzero-run`` jobs of ``lightning_worker.py`` (a tiny Hugging Face
Llama built from a config in a ``LightningModule``; accumulation, a clip that bites and a DeepSpeed ``WarmupLR`` in
every run).

World 2, one job: Lightning's own ``strategy="ddp"`` in float64 (the truth) and fp32 (the reference), then ZeRO stages
1, 2 (native configs) and 3 (a DeepSpeed config with ``"auto"``): each stage's loss curve and final parameters are as
close to the truth as rounding allows, measured by the fp32 DDP run (``ez_numerics.error_ratio`` <= 1). Each stage
saves a sharded checkpoint at step 2. World 1, a second job: each checkpoint resumed at another stage (1→2, 2→3, 3→1)
trains the remaining steps with the uninterrupted run's losses (same rule, the uninterrupted run as the reference); and
a smoke of Lightning's ``precision="bf16-mixed"`` (the engine's bf16) with a validation loop, at stage 3."""

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
import torch

from ez_numerics import error_ratio
from ez_testing import REPO, free_port, pythonpath_with_tests, require

RUN = str(Path(sys.executable).parent / "elasticzero-run")
WORKER = Path(__file__).with_name("lightning_worker.py")
STEPS, RESUMED_AT = 4, 2  # lightning_worker's STEPS and EPOCH_STEPS
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]


def _launch(out: Path, nproc: int, mode: str) -> dict[str, Any]:
    """One ``elasticzero-run`` of the worker on ``nproc`` local ranks; rank 0's report."""
    job = f"ezt-lightning-{secrets.token_hex(4)}"
    argv = [RUN, "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job, str(WORKER), mode, str(out)]
    path = pythonpath_with_tests(REPO / "src", REPO / "tests" / "integration" / "hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    try:
        done = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        kill = [sys.executable, "-m", "elasticzero.agent.cli", "--kill-job", job, "--grace", "2"]
        subprocess.run(kill, capture_output=True, timeout=60, check=False)
        raise
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    report: dict[str, Any] = json.loads((out / f"{mode}.json").read_text())
    return report


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    for package in ("lightning", "transformers"):
        require(importlib.util.find_spec(package) is not None, f"{package} not installed (the test extra pins it)")
    out = tmp_path_factory.mktemp("lightning")
    return out, _launch(out, 2, "world2")


def _tensors(params: dict[str, list[float]]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_trains_as_lightnings_ddp(world2: tuple[Path, dict[str, Any]], stage: int) -> None:
    _, report = world2
    truth, ref, got = report["ddp64"], report["ddp32"], report[f"stage{stage}"]
    assert len(got["losses"]) == len(truth["losses"]) == STEPS
    assert got["losses"][-1] < got["losses"][0]  # it trains
    assert error_ratio(got["losses"], ref["losses"], truth["losses"]) <= 1, (got["losses"], truth["losses"])
    ratio = error_ratio(_tensors(got["params"]), _tensors(ref["params"]), _tensors(truth["params"]))
    assert ratio <= 1, ratio


def test_a_world_2_checkpoint_resumes_at_world_1_at_another_stage(world2: tuple[Path, dict[str, Any]]) -> None:
    out, report = world2
    resumed = _launch(out, 1, "world1")
    truth = report["ddp64"]["losses"][RESUMED_AT:]
    for stage in (1, 2, 3):
        got, ref = resumed[f"resume{stage}"]["losses"], report[f"stage{stage}"]["losses"][RESUMED_AT:]
        assert len(got) == STEPS - RESUMED_AT, got
        assert error_ratio(got, ref, truth) <= 1, (stage, got, ref, truth)
    bf16 = resumed["bf16"]  # precision="bf16-mixed": the engine's bf16 compute copies, validation through the root
    assert bf16["param_dtype"] == "torch.bfloat16" and len(bf16["losses"]) == STEPS
    assert all(math.isfinite(x) for x in [*bf16["losses"], bf16["val_loss"]]), bf16
