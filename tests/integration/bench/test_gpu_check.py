"""``bench/gpu_check.py --device cpu --quick``: every section's code path runs (gloo, tiny models), so the GPU check
cannot rot between the rare runs on a GPU. The report must say it ran on the CPU, every correctness check must pass
and every performance peer must have been measured, with fused-AdamW ratios computed from the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SECTIONS = {"correctness", "example", "checkpoint", "live", "offload", "performance"}
PEERS = {"adamw", "ddp", "fsdp2", "ez_stage1", "ez_stage2", "ez_stage3"}

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]


def test_gpu_check_runs_every_section_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RUNS ON THE CPU" in proc.stdout.splitlines()[0]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["ran_on_gpu"] is False and doc["passed"] is True
    sections = doc["sections"]
    assert set(sections) == SECTIONS
    for name in ("correctness", "example", "checkpoint", "live", "offload"):
        section = sections[name]
        assert section["status"] == "PASS", section
        assert section["checks"] and all(c["ok"] for c in section["checks"]), section["checks"]
    names = {c["name"] for c in sections["correctness"]["checks"]}
    for stage in (1, 2, 3):
        assert any(f"fp32 ZeroStage{stage}" in n for n in names) and any(f"bf16 ZeroStage{stage}" in n for n in names)
    assert sections["correctness"]["data"]["fp32_stage1"]["bitwise"] is True
    assert sections["correctness"]["data"]["fp32_stage2"]["bitwise"] is True
    assert sections["checkpoint"]["environment"]["backend"] == "gloo"
    for stage in (1, 2, 3):  # the host path ran (cpu_copies) and stepped during backward
        assert sections["offload"]["data"][f"stage{stage}_offloaded"]["stepped_in_backward"] is True
        assert sections["offload"]["data"][f"stage{stage}_error_ratio"] <= 1.0
    assert sections["live"]["environment"]["backend"] == "gloo" and sections["live"]["data"]["events"] == [[1, 2]]
    perf = sections["performance"]
    assert perf["status"] == "DONE" and perf["failed"] == []
    assert set(perf["rows"]) == PEERS
    for peer, row in perf["rows"].items():
        assert row["status"] == "ok" and row["step_ms_median"] > 0 and row["timed_steps"] == perf["plan"]["steps"]
        assert perf["ratios"][peer]["step"] == row["step_ms_median"] / perf["rows"]["adamw"]["step_ms_median"]
    assert perf["ratios"]["adamw"] == {"step": 1.0, "memory": 1.0}
    assert "x adamw" in proc.stdout and "[PASS] correctness" in proc.stdout
    overhead = next(line for line in proc.stdout.splitlines() if "world-1 step time / fused AdamW:" in line)
    for stage in (1, 2, 3):  # each stage's ratio, as the table computed it
        assert f"stage{stage} {perf['ratios'][f'ez_stage{stage}']['step']:.2f}x" in overhead
