"""The plan's worker environment reaches each worker through the agent's start hook, not the agent's os.environ.

Built as ``launch`` builds it (handler, ``WorkerSpec``, ``LogsSpecs`` from a plan; an in-process c10d store), then
torch's own per-worker hook is called as ``_start_workers`` calls it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from elasticzero.agent.agent import ElasticZeroAgent
from elasticzero.agent.binding import AGENT_PID_ENV, CPUS_ENV, JOB_ID_ENV
from elasticzero.agent.cli import build_parser
from elasticzero.agent.launch import build_logs_specs, rdzv_parameters, worker_spec
from elasticzero.agent.plan import AgentFacts, AgentPlan, plan_agent
from ez_testing import free_port

pytestmark = pytest.mark.timeout(60)


def _plan(tmp_path: Path, *flags: str) -> AgentPlan:
    argv = ["--node-table", '[["127.0.0.1",[4,6]]]', "--node-rank", "0", "--rdzv-backend", "elasticzero"]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hook", "--log-dir", str(tmp_path), *flags]
    facts = AgentFacts(pid=os.getpid(), python="/py", package_root="/site", run_id="x", cores=(0, 1))
    return plan_agent(build_parser().parse_args([*argv, "train.py"]), dict(os.environ), facts)


@pytest.mark.parametrize("virtual", [False, True])
def test_each_worker_gets_the_plans_env_from_the_hook(tmp_path: Path, virtual: bool) -> None:
    plan = _plan(tmp_path, "--bind-cores-to-rank", *(["--virtual-local-rank"] if virtual else []))
    params = rdzv_parameters(plan.rdzv)
    handler = rdzv_registry.get_rendezvous_handler(params)
    before = dict(os.environ)
    try:
        spec = worker_spec(plan, handler, params)
        agent = ElasticZeroAgent(spec, build_logs_specs(plan.workers.logs), worker_env=plan.workers.worker_env)
        envs: list[dict[str, str | None]] = [{}, {}]
        for local_rank, env in enumerate(envs):
            agent._set_local_rank_env(env, local_rank, spec)
    finally:
        handler.shutdown()
    assert dict(os.environ) == before  # nothing went through the agent's own environment
    assert [e["LOCAL_RANK"] for e in envs] == (["0", "0"] if virtual else ["0", "1"])  # torch's rule in each mode
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == (["4", "6"] if virtual else ["4,6", "4,6"])
    assert [e[CPUS_ENV] for e in envs] == ["0", "1"]
    assert {(e[JOB_ID_ENV], e[AGENT_PID_ENV]) for e in envs} == {("hook", str(os.getpid()))}
