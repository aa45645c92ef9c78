"""``bench/engine_bench.py --largest`` (the GPU mode: the largest GPT per peer at world 1, ZeRO-Offload against
FSDP2's CPUOffloadPolicy): its plan parses and prints anywhere (``--dry-run``), and its decisions — the search that
stops at the first size that does not train, the largest model, the ratios of issue 30 — on tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "bench")]

import engine_bench  # noqa: E402


def row(status: str = "ok", ms: float = 100.0, params: int = 1) -> dict[str, Any]:
    return {"status": status, "step_ms_median": ms, "params": params}


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path: Path) -> None:
    argv = [sys.executable, str(REPO / "bench" / "engine_bench.py"), "--largest", "--device", "cuda", "--dry-run"]
    proc = subprocess.run([*argv, "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sizes gpt350m, gpt1b" in proc.stdout and "would run: _worker.py --peer=fsdp2_offload" in proc.stdout
    assert not (tmp_path / "x.json").exists()


def test_largest_mode_arguments() -> None:
    args = engine_bench.parse_args(["--largest", "--device", "cuda"])
    assert (args.world_size, args.precision, args.warmup, args.steps) == (1, "bf16", 1, 3)
    assert args.peers.split(",") == list(engine_bench.LARGEST_PEERS)
    chosen = engine_bench.parse_args(["--largest", "--peers", "ez_stage3_offload,fsdp2_offload", "--sizes", "gpt7b"])
    assert chosen.peers == "ez_stage3_offload,fsdp2_offload" and chosen.sizes == "gpt7b"
    for bad in (["--largest", "--sizes", "gpt9000"], ["--largest", "--world-size", "8"]):
        with pytest.raises(SystemExit):
            engine_bench.parse_args(bad)


def test_the_search_stops_at_the_first_size_that_does_not_train() -> None:
    tried: list[str] = []

    def attempt(size: str) -> dict[str, Any]:
        tried.append(size)
        return row("CUDA out of memory" if size == "c" else "ok")

    rows = engine_bench.search_largest("p", ["a", "b", "c", "d"], attempt)
    assert tried == ["a", "b", "c"] and engine_bench.largest_trained(rows) == "b"
    assert engine_bench.largest_trained({"a": row("OOM")}) is None


def test_offload_verdict() -> None:
    results = {
        "ez_stage3": {"a": row(params=10), "b": row("OOM")},
        "ez_stage3_offload": {"a": row(ms=40, params=10), "b": row(ms=90, params=20), "c": row(ms=200, params=30)},
        "fsdp2_offload": {"a": row(ms=100, params=10), "b": row(ms=200, params=20), "c": row("OOM")},
    }
    verdict = engine_bench.offload_verdict(results)
    assert verdict["largest"] == {"ez_stage3": "a", "ez_stage3_offload": "c", "fsdp2_offload": "b"}
    assert verdict["common_size"] == "b"  # the largest both head-to-head peers trained
    assert verdict["step_ratio"] == {"ez_stage3_offload": pytest.approx(0.45)}
    assert verdict["model_ratio"] == pytest.approx(1.5)
    lines = "\n".join(engine_bench.verdict_lines(verdict))
    assert "0.45x (goal <= 0.5x)" in lines and "1.50x (goal >= 1x)" in lines
