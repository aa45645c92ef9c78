"""Slurm: ``srun --nodelist=h1,h2 --nodes=2 --ntasks-per-node=1 --export=ALL … <agent>``.

The exported variables are set in srun's own environment and ``--export=ALL`` hands them to the tasks: values
with commas or quotes survive, where ``--export=ALL,NAME=value`` would split or garble them. Slurm orders tasks by
its own node order, so each agent finds its row of the node table by ``SLURMD_NODENAME`` (node ranks stay in
hostfile order; hostfile names must be Slurm node names). Per-rank mode: ``--ntasks-per-node=k --ntasks=N``,
``rankenv`` maps ``SLURM_LOCALID`` + ``SLURMD_NODENAME`` to ranks in hostfile order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero_plugins._common import check_plan, job_env, per_rank, rankenv_argv, uniform_slots

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan

NODE_NAME_VAR = "SLURMD_NODENAME"


class SlurmBackend(LauncherBackend):
    """One ``srun`` step starting one agent per node (or every rank, in per-rank mode)."""

    name = "slurm"
    required_programs = ("srun",)

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        n = len(plan.nodes)
        argv = ["srun", f"--nodelist={','.join(x.host for x in plan.nodes)}", f"--nodes={n}"]
        if per_rank(plan):
            k = uniform_slots(plan, self.name)
            argv += [f"--ntasks-per-node={k}", f"--ntasks={n * k}"]
            prog = rankenv_argv(plan, node_host_env=NODE_NAME_VAR)
        else:
            argv += ["--ntasks-per-node=1", f"--ntasks={n}"]
            prog = plan.agent_argv(["--node-host-env", NODE_NAME_VAR])
        argv += ["--export=ALL", f"--chdir={plan.cwd}"]
        return [Command(argv=(*argv, *plan.launcher_args, *prog), env=job_env(plan))]
