"""MPICH hydra: ``mpiexec.hydra -hosts h1,h2 -ppn 1 -n N -genvlist A,B … <agent>``.

``-genvlist`` forwards exactly the named variables (values stay in the command's own environment). Hydra's
proxies call back to the launching host by its hostname; from a host whose name does not resolve to a reachable
address (a namespace test bed's root) add ``--launcher-args "-localhost <addr>"``. Each agent finds its node
from ``PMI_RANK``. Per-rank mode: ``-hosts h1:k,h2:k -n N`` starting ``rankenv`` directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticzero.launch.backend import BackendOption, Command, LauncherBackend
from elasticzero_plugins._common import PER_RANK, check_plan, job_env, per_rank, rankenv_argv

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan

#: a variable placed last in mpiexec's environment, not forwarded (see :func:`hydra_command`)
HYDRA_ENV_PAD = "ELASTICZERO_HYDRA_ENV_PAD"


def hydra_command(plan: LaunchPlan, mpiexec: str, backend: str) -> Command:
    """The hydra ``mpiexec`` command (shared with MVAPICH2's hydra flavour)."""
    check_plan(plan, backend)
    env = job_env(plan)
    argv = [mpiexec]
    if per_rank(plan):
        argv += ["-hosts", ",".join(f"{n.host}:{len(n.slots)}" for n in plan.nodes), "-n", str(plan.world_size)]
        prog = rankenv_argv(plan)
    else:
        argv += ["-hosts", ",".join(n.host for n in plan.nodes), "-ppn", "1", "-n", str(len(plan.nodes))]
        prog = plan.agent_argv(["--node-rank-env", "PMI_RANK"])
    argv += ["-wdir", plan.cwd, "-genvlist", ",".join(env)]
    # Hydra 4.0.2 skips the last entry of its own environment block when it applies -genvlist (verified: the
    # variable is lost whenever it is last). execute() puts the command's env last, in order: end it with a pad.
    return Command(argv=(*argv, *plan.launcher_args, *prog), env={**env, HYDRA_ENV_PAD: "1"})


class MPICHBackend(LauncherBackend):
    """One hydra ``mpiexec`` starting one agent per host (or every rank, in per-rank mode)."""

    name = "mpich"
    required_programs = ("mpiexec.hydra",)
    options = (PER_RANK, BackendOption("mpiexec", str, "mpiexec.hydra", "the hydra mpiexec program to run"))

    def commands(self, plan: LaunchPlan) -> list[Command]:
        return [hydra_command(plan, plan.options["mpiexec"], self.name)]
