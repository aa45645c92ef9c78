"""The autotuner's unit tests describe a CPU host whatever the machine: the pool's local slots come from
``--nproc-per-node`` there, and a GPU machine would make them its GPU count (the launcher's tests pin the same)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticzero.launch import resources


@pytest.fixture(autouse=True)
def cpu_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(resources, "detect_gpu_count", lambda: 0)
    monkeypatch.setattr(resources, "DEFAULT_HOSTFILE", str(tmp_path / "no-default-hostfile"))
    for name in ("CUDA_VISIBLE_DEVICES", "ELASTICZERO_HOSTFILE", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
