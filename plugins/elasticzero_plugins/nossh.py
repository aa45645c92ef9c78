"""Per-node mode (``--no-ssh``): the user runs ``elasticzero-launch --no-ssh --node-rank R`` on every node.

Only this node's agent starts, as a local process, with ``--node-rank R`` (``node_rank`` option); the others
join the same rendezvous when their own launcher starts, exactly like running torchrun on each node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.backend import BackendOption, Command, LauncherBackend
from elasticzero_plugins._common import check_plan, job_env

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan


class NoSSHBackend(LauncherBackend):
    """This node's agent only; node identity from ``--node-rank``."""

    name = "no-ssh"
    replaces_launcher = True  # one local agent: the launcher execs it
    options = (BackendOption("node_rank", int, None, "this node's rank in the hostfile order", flag="--node-rank"),)

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        r = plan.options["node_rank"]
        if r is None:
            raise UsageError("--no-ssh needs --node-rank R (this node's rank in the hostfile order)")
        if not 0 <= r < len(plan.nodes):
            raise UsageError(f"--node-rank {r} is out of range: the plan has nodes 0..{len(plan.nodes) - 1}")
        argv = plan.agent_argv(["--node-rank", str(r)])
        return [Command(argv=tuple(argv), env=job_env(plan), host=plan.nodes[r].host)]
