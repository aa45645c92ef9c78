"""Engine objects must not keep a destroyed process group alive.

Holding the group strongly kept gloo's worker threads running after ``destroy_process_group()``; they drop their
last references to the tensors of the final collectives later, may need the GIL while the interpreter finalizes,
and then abort the process ("terminate called without an active exception", exit -6 — seen intermittently with
ZeroStage2 under load). The deterministic symptom checked here: once the group is destroyed, its threads are gone
even though every optimizer, bucketer and scaler built on it is still alive; the rank processes exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ez_testing import free_port

WORKER = Path(__file__).with_name("shutdown_worker.py")


def run_ranks(out: Path, *mode: str) -> list[dict[str, Any]]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out), *mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for rank, p in enumerate(procs):
        _stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{stderr[-3000:]}"
        assert "terminate called" not in stderr, stderr[-3000:]
        results.append(json.loads(Path(f"{out}.rank{rank}").read_text()))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("shutdown") / "result")


def test_destroy_joins_the_group_threads_while_engine_objects_live(ranks: list[dict[str, Any]]) -> None:
    # no torch._dynamo imported up front by the script: the engine keeps torch.distributed.nn from pinning the group
    for r in ranks:
        assert r["pinned"] is False, r
        assert r["live"] > r["before_init"], r  # the groups' threads existed while training
        assert r["after_destroy"] == r["before_init"], r  # ... and are joined by destroy_process_group()


def test_engine_imported_after_init_unpins_the_default_group(tmp_path: Path) -> None:
    # the script initialises the group before importing the engine: torch.distributed.nn's defaults pin the group
    # until the first engine object puts None back; then destroy_process_group() joins the threads as above
    for r in run_ranks(tmp_path / "result", "late"):
        assert r["pinned_at_import"] is True, r
        assert r["pinned"] is False, r
        assert r["after_destroy"] == r["before_init"], r


def test_use_after_destroy_is_one_clear_error(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert sorted(r["errors"]) == ["bucketer", "scaler", "stage1", "stage2", "stage3"], r
        for msg in r["errors"].values():
            assert "was destroyed (destroy_process_group)" in msg, msg


def test_no_backend_thread_holds_engine_tensors_after_a_step(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["unsettled"] == [0] * 7, r  # 3 stages x 2 steps, then the bucketer's backward
