"""The HF ``Trainer`` door's restart path end to end: two ``elasticzero-run --nnodes 1:2 --nproc-per-node 1`` agents
("nodes" on loopback, a c10d rendezvous the first one hosts) run ``hf_restart_worker.py`` — a ``ZeroTrainer`` at
stage 2 written as docs/integrations-hf.md says, ``train(resume_from_checkpoint=last_checkpoint(...) or None)``, a
checkpoint every 2 of 4 steps. Once both ranks have saved ``checkpoint-2`` (the world holds there), the second node —
agent and worker — is SIGKILLed; the survivor's agent restarts its worker at world 1, which resumes from
``checkpoint-2`` and trains steps 3 and 4. The job exits 0; the steps record shows the resume at step 2 and each step
trained once; the final model and the loss curve equal the uninterrupted run's (the plain ``Trainer`` at world 1,
trained in the same last worker, in fp32 and float64) by the ``ez_numerics`` rule.

One job: 2 agents, 3 workers (2 at world 2, 1 at world 1; a first world-1 worker when the first agent starts alone,
waiting at a gate until the second joins).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from ez_agentkit import ELASTICZERO_RUN, FAST_RDZV, Cluster, wait_for

from elasticzero.agent.proctree import descendants, kill_now
from ez_numerics import error_ratio
from ez_testing import free_port, pythonpath_with_tests, require

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("hf_restart_worker.py")
STEPS, SAVE = 4, 2


def agent_argv(cluster: Cluster, endpoint: str) -> list[str]:
    argv = [str(ELASTICZERO_RUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", cluster.job_id, "--rdzv-conf", FAST_RDZV]
    return [*argv, "--max-restarts", "3", "--monitor-interval", "0.2", str(WORKER), str(cluster.out)]


def events(out: Path) -> list[dict]:
    lines = [line for path in sorted(out.glob("events.*.jsonl")) for line in path.read_text().splitlines()]
    return sorted((json.loads(line) for line in lines), key=lambda e: e["time"])


def held(out: Path) -> bool:
    """Both ranks of the world of 2 hold after their save at step 2."""
    return sorted(e["rank"] for e in events(out) if e["event"] == "held") == [0, 1]


def run_job(cluster: Cluster) -> None:
    """Two nodes to the checkpoint at step 2, the second node SIGKILLed, the survivor to the end (exit 0)."""
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env["PYTHONPATH"] = pythonpath_with_tests(Path(__file__).parent)
    endpoint = f"127.0.0.1:{free_port()}"
    (cluster.out / "gate").touch()  # a world of 1 before the second node joins waits here
    cluster.start(agent_argv(cluster, endpoint), env)
    cluster.wait_store(endpoint)  # agent 0 hosts the rendezvous store: the other one is the node lost
    cluster.start(agent_argv(cluster, endpoint), env)
    wait_for(lambda: held(cluster.out), 300, "checkpoint-2 saved at world 2", cluster.agents)
    victim = cluster.agents[1].proc
    kill_now(descendants([victim.pid]))  # the node: its agent and its worker, at once
    victim.wait(timeout=10)
    rc = cluster.agents[0].proc.wait(timeout=300)
    assert rc == 0, cluster.agents[0].output()[-4000:]
    assert cluster.leftovers() == []  # nothing of the job outlives it: the lost node's worker included


def test_a_node_lost_restarts_the_trainer_from_the_newest_checkpoint(cluster: Cluster) -> None:
    for name in ("transformers", "accelerate"):
        require(importlib.util.find_spec(name) is not None, f"{name} missing: pip install -e '.[test]'")
    start = time.monotonic()
    run_job(cluster)
    print(f"job: {time.monotonic() - start:.1f} s")
    out, record = cluster.out, events(cluster.out)
    begins = [e for e in record if e["event"] == "begin"]
    # the world of 2 started from nothing and trained steps 1 and 2 on both ranks; then only the world-1 restart
    assert [(e["world"], e["step"], e["resume"]) for e in begins] == [
        (2, 0, None),
        (2, 0, None),
        (1, SAVE, str(out / "run" / f"checkpoint-{SAVE}")),
    ]
    steps = [(e["world"], e["rank"], e["step"]) for e in record if e["event"] == "step"]
    assert sorted(steps) == sorted([(2, r, s) for r in (0, 1) for s in (1, 2)] + [(1, 0, 3), (1, 0, 4)])

    report = json.loads((out / "report.json").read_text())
    assert report["last_checkpoint"] == str(out / "run" / f"checkpoint-{STEPS}")
    curve = {e["step"]: e["loss"] for e in record if e["event"] == "loss" and e["rank"] == 0}
    assert sorted(curve) == list(range(1, STEPS + 1))
    got = [curve[s] for s in range(1, STEPS + 1)]
    params = torch.load(out / "params.pt")
    assert params["elastic"].keys() == params["truth"].keys()
    ratios = (
        # the Trainer logs every run's loss through its fp32 sum, the float64 truth's too: two stores (ez_numerics)
        error_ratio(got, report["ref_losses"], report["truth_losses"], fp32_stores=2),
        error_ratio(params["elastic"], params["ref"], params["truth"]),
    )
    print(f"error ratios (<= 1): losses {ratios[0]:.3f}, final parameters {ratios[1]:.3f}")
    assert max(ratios) <= 1, ratios
