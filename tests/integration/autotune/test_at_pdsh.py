"""Two experiments at once on two namespace hosts over pdsh, never two on one host's cores.

The test bed's hosts (network + UTS namespaces with sshd) share this machine's process table and filesystem, so
the tuner's journal and every host's processes are visible here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ez_testing
from elasticzero.agent.proctree import processes_with_env
from ez_testing import free_port, require_program

pytestmark = [pytest.mark.multiproc, pytest.mark.pdsh, pytest.mark.sshd, pytest.mark.timeout(400)]

TRIAL = str(Path(__file__).with_name("at_trial.py"))


def test_two_hosts_run_experiments_concurrently_one_per_host(tmp_path: Path) -> None:
    tb = ez_testing.testbed()
    require_program("pdsh", "ssh")
    hosts = list(tb.hosts[:2])
    (tmp_path / "hosts").write_text("".join(f"{h} slots=2\n" for h in hosts))
    (tmp_path / "cfg.yaml").write_text(
        "zero: {stage: 1}\nmicro_batch_size: 1\naccumulation_steps: 4\ntrain_batch_size: 8\n"
        "optimizer: {type: SGD, params: {lr: 0.1}}\n"
        "autotuning: {tuner: grid, nodes: 1, slots_per_node: 2, space: {stage: [1, 2, 3], micro_batch: [4]}, "
        "warmup_steps: 1, measure_steps: 3, timeout: 300}\n"
    )
    argv = [sys.executable, "-m", "elasticzero.autotune.cli", "--hostfile", str(tmp_path / "hosts")]
    argv += ["--launcher", "pdsh", "--master-port", str(free_port()), TRIAL, "--config", "cfg.yaml"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EZ_AT_", "ELASTICZERO_"))}
    p = subprocess.run(argv, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=360, check=False)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "autotuning_results/journal.jsonl").read_text().splitlines()]
    starts = {r["key"]: r for r in records if r["event"] == "start"}
    ends = {r["key"]: r["time"] for r in records if r["event"] == "finish"}
    assert len(starts) == len(ends) == 3  # 3 experiments on 2 hosts: one host runs two, one after the other
    intervals = [(s["hosts"], s["time"], ends[k]) for k, s in starts.items()]
    assert all(len(h) == 1 and h[0] in hosts for h, _, _ in intervals)
    for a in intervals:  # one experiment per host at a time; experiments on the two hosts overlapped
        for b in intervals:
            if a is not b and a[0] == b[0]:
                assert a[2] <= b[1] or b[2] <= a[1], f"two experiments shared {a[0]}"
    overlapped = any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in intervals for b in intervals)
    assert overlapped, "no two experiments ran at the same time on different hosts"
    statuses = [r["outcome"]["status"] for r in records if r["event"] == "finish"]
    assert statuses == ["ok"] * 3
    for r in starts.values():
        assert processes_with_env("ELASTICZERO_JOB_ID", r["job_id"]) == []
