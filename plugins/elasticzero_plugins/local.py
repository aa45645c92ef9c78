"""Single node: run ``elasticzero-run --node-rank 0`` directly (no transport)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero_plugins._common import check_plan, job_env

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan


class LocalBackend(LauncherBackend):
    """The agent of a one-node plan, started as a local process."""

    name = "local"
    replaces_launcher = True  # one local agent: the launcher execs it

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        if len(plan.nodes) != 1:
            raise UsageError(
                f"launcher 'local' runs one node, but the plan has {len(plan.nodes)}; "
                "pick a multi-node --launcher (pdsh, openmpi, mpich, slurm) or --no-ssh on each node"
            )
        argv = plan.agent_argv(["--node-rank", "0"])
        return [Command(argv=tuple(argv), env=job_env(plan), host=plan.nodes[0].host)]
