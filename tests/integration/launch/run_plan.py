"""Run one LaunchPlan described by a JSON file: ``python run_plan.py SPEC.json`` → exit code of ``execute()``.

Tests start this as a separate process so that signals sent to "the launcher" hit a real launcher process.
Spec keys: job_id, backend, nodes [[host, [slots]]], master_port, entry, cwd, env, options, launcher_args, python.
"""

from __future__ import annotations

import json
import sys

from elasticzero.errors import UsageError
from elasticzero.launch.backend import get_launcher
from elasticzero.launch.execute import execute
from elasticzero.launch.plan import AgentOptions, LaunchPlan, NodeSpec


def plan_from_spec(spec: dict) -> LaunchPlan:
    nodes = tuple(NodeSpec(h, i, tuple(s)) for i, (h, s) in enumerate(spec["nodes"]))
    return LaunchPlan(
        job_id=spec["job_id"],
        backend=spec["backend"],
        nodes=nodes,
        master_addr=spec.get("master_addr", nodes[0].host),
        master_port=int(spec["master_port"]),
        entry=tuple(spec["entry"]),
        cwd=spec["cwd"],
        agent=AgentOptions(nnodes=str(len(nodes)), python=spec["python"], monitor_interval=0.5),
        env=dict(spec.get("env", {})),
        launcher_args=tuple(spec.get("launcher_args", ())),
        options=dict(spec.get("options", {})),
    )


def main() -> int:
    with open(sys.argv[1]) as f:
        plan = plan_from_spec(json.load(f))
    backend = get_launcher(plan.backend)
    try:
        bound = backend.bind(plan)
        backend.check_available()
        backend.preflight(bound)
    except UsageError as exc:
        print(f"run_plan: error: {exc}", file=sys.stderr)
        return 2
    return execute(bound, backend)


if __name__ == "__main__":
    sys.exit(main())
