"""The accelerate front door (``elasticzero.integrations.accelerate``, docs/integrations-accelerate.md), trained.

Three launched jobs, each running several configurations in sequence (``accelerate_worker``):

- ``elasticzero-run`` at 2 ranks: the same ``Accelerator`` loop (accumulation over 2 micro-batches per rank, clipping
  through ``accelerator.clip_grad_norm_``, a warm-up schedule) on a tiny Llama with a plain ``Accelerator`` (DDP, fp32:
  the reference; float64: the truth) and with ``ZeroAccelerator`` on stages 1, 2, 3, each saving with ``save_state``;
- ``elasticzero-run`` at 1 rank: each checkpoint resumed at world 1 on another stage;
- ``accelerate launch --multi_gpu --num_processes 2 --rdzv_backend elasticzero`` (our rendezvous, 2 CPU ranks): stage
  2 with a loss scaler whose first step overflows.

Loss curves and parameters are compared by ``ez_numerics.error_ratio`` (at most 1: as close to the float64 truth as
the fp32 reference is, times 3).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ez_numerics import error_ratio
from ez_testing import REPO, free_port, pythonpath_with_tests, require

WORKER = Path(__file__).with_name("accelerate_worker.py")
BIN = Path(sys.executable).parent
STAGES = (1, 2, 3)
SAVE_AT, MAX_NORM = 1, 0.5  # the worker's
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    path = pythonpath_with_tests(REPO / "src")
    # HF_HOME: accelerate reads no user config (its default_config.yaml lives there); nothing is downloaded
    base = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"), "PYTHONPATH": path}
    return {**os.environ, **base, "TRANSFORMERS_VERBOSITY": "error", **extra}


def _run(argv: list[str], env: dict[str, str], log: Path) -> None:
    """Run a launcher in its own session; on a timeout its whole process group (its workers) is killed."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    assert rc == 0, log.read_text()[-6000:]


def _reports(out: Path, mode: str, world: int) -> list[dict[str, Any]]:
    reports = [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(world)]
    assert all("error" not in r for r in reports), reports
    return reports


def _elastic_run(out: Path, mode: str, world: int) -> list[dict[str, Any]]:
    endpoint, job = f"127.0.0.1:{free_port()}", f"ezt-accel-{secrets.token_hex(4)}"
    argv = [str(BIN / "elasticzero-run"), "--nproc-per-node", str(world), "--rdzv-backend", "elasticzero"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", job, str(WORKER), mode, str(out)]
    _run(argv, _env(out), out / f"{mode}.log")
    return _reports(out, mode, world)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require(importlib.util.find_spec("accelerate") is not None, "accelerate not installed (the test extra pins it)")
    require(importlib.util.find_spec("transformers") is not None, "transformers not installed (the test extra)")
    return tmp_path_factory.mktemp("accelerate")


@pytest.fixture(scope="module")
def compared(out: Path) -> dict[str, Any]:
    ranks = _elastic_run(out, "compare", 2)
    assert ranks[0]["world"] == 2
    for key in ("ddp32", "ddp64", *(f"s{s}" for s in STAGES)):  # the loss is the global batch's: same on each rank
        assert ranks[0][key]["losses"] == ranks[1][key]["losses"], key
    return ranks[0]


def _curve_ratio(run: dict[str, Any], compared: dict[str, Any], key: str, start: int = 0) -> float:
    return error_ratio(run[key], compared["ddp32"][key][start:], compared["ddp64"][key][start:])


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_trains_like_the_same_loop_under_ddp(compared: dict[str, Any], stage: int) -> None:
    run, ddp = compared[f"s{stage}"], compared["ddp32"]
    assert ddp["ddp_wrapped"] and not run["ddp_wrapped"]  # prepare left the engine's model alone
    assert sum(n > MAX_NORM for n in ddp["norms"]) > 0  # the clip acts: its norm and its scaling are compared
    assert _curve_ratio(run, compared, "losses") <= 1, (run["losses"], ddp["losses"], compared["ddp64"]["losses"])
    assert _curve_ratio(run, compared, "norms") <= 1, (run["norms"], ddp["norms"])
    assert run["params_ratio"] <= 1
    assert Path(run["saved"]).name == f"step-{SAVE_AT:08d}" and Path(run["saved"]).is_dir()  # what save_state said
    assert run["skipped"] == [False] * len(run["losses"]) and run["lr"] == ddp["lr"]


def test_save_model_writes_the_stage3_model_gathered(compared: dict[str, Any]) -> None:
    assert compared["s3"]["saved_model_equal"]


@pytest.fixture(scope="module")
def resumed(out: Path, compared: dict[str, Any]) -> dict[str, Any]:
    (report,) = _elastic_run(out, "resume", 1)
    assert report["world"] == 1
    return report


@pytest.mark.parametrize("saved", STAGES)
def test_a_checkpoint_of_two_ranks_resumes_at_one_rank_on_another_stage(
    compared: dict[str, Any], resumed: dict[str, Any], saved: int
) -> None:
    run = resumed[f"s{saved}"]
    assert run["stage"] != saved and run["steps_loaded"] == SAVE_AT
    assert _curve_ratio(run, compared, "losses", SAVE_AT) <= 1, (run["losses"], compared[f"s{saved}"]["losses"])
    assert _curve_ratio(run, compared, "norms", SAVE_AT) <= 1


def test_accelerate_launch_with_the_elasticzero_rendezvous(out: Path) -> None:
    """``accelerate launch`` starts the workers through torch.distributed.run with ``--rdzv_backend elasticzero``
    (the endpoint from ``PET_RDZV_ENDPOINT``: accelerate sets it only for several machines; ``ACCELERATE_USE_CPU``:
    accelerate's own switch for CPU ranks, which ``--cpu`` would start as one process)."""
    exe = BIN / "accelerate"
    require(exe.exists(), f"{exe} missing (accelerate's console script)")
    job = f"ezt-accel-{secrets.token_hex(4)}"
    env = _env(out, ACCELERATE_USE_CPU="1", PET_RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", PET_RDZV_ID=job)
    argv = [str(exe), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision"]
    argv += ["no", "--dynamo_backend", "no", "--rdzv_backend", "elasticzero", "--main_process_port", "0"]
    _run([*argv, str(WORKER), "launch", str(out)], env, out / "launch.log")
    ranks = _reports(out, "launch", 2)
    report = ranks[0]
    assert report["world"] == 2 and {r["run_id"] for r in ranks} == {job}
    assert ranks[0]["overflow"] == ranks[1]["overflow"]

    over = report["overflow"]  # step 0 overflowed on the huge scale: skipped everywhere, as accelerate reports it
    assert over["skipped"] == [True] and over["unchanged_after_skip"] and math.isinf(over["norms"][0])
    assert over["sched_epoch"] == 0 and over["scale"] == 2.0**26  # the schedule waited; the scale backed off 2^-100
    assert over["next_skipped"] == [False] and over["sched_epoch_next"] == 1
