"""A LaunchPlan factory for the backend unit tests."""

from __future__ import annotations

from typing import Any

from elasticzero.launch.plan import AgentOptions, LaunchPlan, NodeSpec

PY = "/opt/py/bin/python"
HOSTILE = [
    "a;echo PWNED",
    "$(touch /tmp/ez-pwned)",
    "`touch /tmp/ez-pwned`",
    "it's",
    'dq"x',
    "two words",
    "#hash",
    "*",
    "new\nline",
    "%h %n %% 100%",
    "",
    "back\\slash",
]


def make_plan(
    backend: str,
    nodes: list[tuple[str, list[int]]] | None = None,
    *,
    env: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    launcher_args: tuple[str, ...] = (),
    entry: tuple[str, ...] = ("train.py", "--lr", "0.1"),
    cwd: str = "/work/dir",
    module: bool = False,
    no_python: bool = False,
) -> LaunchPlan:
    nodes = nodes or [("node1", [0, 1]), ("node2", [2, 3])]
    return LaunchPlan(
        job_id="ez-test-1",
        backend=backend,
        nodes=tuple(NodeSpec(h, i, tuple(s)) for i, (h, s) in enumerate(nodes)),
        master_addr=nodes[0][0],
        master_port=29500,
        entry=entry,
        cwd=cwd,
        agent=AgentOptions(nnodes=str(len(nodes)), python=PY, module=module, no_python=no_python),
        env={"NCCL_DEBUG": "INFO"} if env is None else env,
        launcher_args=launcher_args,
        options=options or {},
    )
