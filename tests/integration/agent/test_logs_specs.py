"""Per-rank log files through plain ``torchrun --logs-specs elasticzero`` (entry point); elasticzero-run's default
(its own logs spec, ``--tee``) is asserted on test_run_basic's one-agent run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ez_agentkit import WORKER, Cluster

from ez_testing import run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_torchrun_logs_specs_entry_point(cluster: Cluster) -> None:
    logs = cluster.tmp / "logs"
    argv = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--rdzv-id", "ignored", "--logs-specs"]
    argv += ["elasticzero", "--log-dir", str(logs), "--redirects", "3", str(WORKER), str(cluster.out)]
    done = run(argv, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = logs.iterdir()  # --standalone picks a fresh run id
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == [f"rank{r}.attempt0.{s}.log" for r in (0, 1) for s in ("stderr", "stdout")]
    assert (run_dir / "rank0.attempt0.stdout.log").read_text().strip() == "hello from rank 0"
