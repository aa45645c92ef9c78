"""OpenMPI: ``mpirun.openmpi --allow-run-as-root --bind-to none -H h1,h2 -npernode 1 -x NAME … <agent>``.

Environment crosses by name only (``-x NAME``; the values sit in the command's own environment), so no value is
ever quoted. ``--bind-to none`` matters: OpenMPI binds to a core by default when np ≤ 2, pinning the agent and
every worker to one CPU. Each agent finds its node from ``OMPI_COMM_WORLD_RANK`` (one rank per host, ``-H``
order = hostfile order). Per-rank mode: ``-H h1:k,h2:k -np N --map-by slot`` starting ``rankenv`` directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero_plugins._common import PER_RANK, check_plan, job_env, per_rank, rankenv_argv

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan

MPIRUN = "mpirun.openmpi"


class OpenMPIBackend(LauncherBackend):
    """One ``mpirun`` starting one agent per host (or every rank, in per-rank mode)."""

    name = "openmpi"
    required_programs = (MPIRUN,)
    options = (PER_RANK,)

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        env = job_env(plan)
        argv = [MPIRUN, "--allow-run-as-root", "--bind-to", "none", "-wdir", plan.cwd]
        if per_rank(plan):
            argv += ["-H", ",".join(f"{n.host}:{len(n.slots)}" for n in plan.nodes)]
            argv += ["-np", str(plan.world_size), "--map-by", "slot"]
            prog = rankenv_argv(plan)
        else:
            argv += ["-H", ",".join(n.host for n in plan.nodes), "-npernode", "1", "-np", str(len(plan.nodes))]
            prog = plan.agent_argv(["--node-rank-env", "OMPI_COMM_WORLD_RANK"])
        for name in env:
            argv += ["-x", name]
        return [Command(argv=(*argv, *plan.launcher_args, *prog), env=env)]
