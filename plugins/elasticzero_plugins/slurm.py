"""Slurm: ``srun --nodelist=h1,h2 --nodes=2 --ntasks-per-node=1 --export=ALL … <agent>``.

The exported variables are set in srun's own environment and ``--export=ALL`` hands them to the tasks: values
with commas or quotes survive, where ``--export=ALL,NAME=value`` would split or garble them. Slurm orders tasks by
its own node order, so each agent finds its row of the node table by ``SLURMD_NODENAME`` (node ranks stay in
hostfile order; hostfile names must be Slurm node names). Per-rank mode: ``--ntasks-per-node=k --ntasks=N``,
``rankenv`` maps ``SLURM_LOCALID`` + ``SLURMD_NODENAME`` to ranks in hostfile order.

CPUs in agent mode: one task per node is the agent *and all of its workers*, but Slurm gives a task one CPU by
default (``CR_Core``/``CR_CPU``), which ``task/affinity`` or ``task/cgroup`` then enforce. So the step asks for
``--cpu-bind=none`` (no binding to the task's first CPU; the agent binds workers itself with
``--bind-cores-to-rank``) and for every CPU it may have on the node, always through ``--cpus-per-task=C``:

* inside an allocation, C is the smallest CPU count the allocation has on a node (:func:`allocated_cpus`);
* outside one, srun makes the allocation: ``--exclusive`` (whole nodes) and C = the smallest CPU count
  ``sinfo`` reports for the plan's nodes. ``--exclusive`` alone is not enough: it makes the step exact
  (Slurm 22.05 gave the step 1 CPU per node of the 2 the job held). If sinfo cannot tell, ``--exclusive`` is
  passed alone and the step may be limited to one CPU per node on a cluster that enforces CPU sets.

``--launcher-args`` come later on the line and override these (e.g. ``--launcher-args "--cpus-per-task=16"``).
On a cluster with ``TaskPlugin=task/none`` srun warns that it "lacks support for cpu binding"; that is harmless.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero_plugins._common import PER_RANK, check_plan, job_env, per_rank, rankenv_argv, uniform_slots

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan

NODE_NAME_VAR = "SLURMD_NODENAME"
_CPUS_ITEM = re.compile(r"(\d+)(?:\(x\d+\))?")


def allocated_cpus(env: Mapping[str, str]) -> int | None:
    """CPUs per node of the surrounding allocation (the smallest, when nodes differ), or ``None`` if unknown.

    ``SLURM_JOB_CPUS_PER_NODE`` (``"4(x2),2"``) covers every node of the allocation; ``SLURM_CPUS_ON_NODE``
    (this node only) is the fallback. Unparsable values count as unknown.
    """
    counts: list[int] = []
    for item in env.get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        m = _CPUS_ITEM.fullmatch(item.strip())
        if m is None:
            counts = []
            break
        counts.append(int(m.group(1)))
    if not counts and env.get("SLURM_CPUS_ON_NODE", "").strip().isdigit():
        counts = [int(env["SLURM_CPUS_ON_NODE"])]
    best = min(counts) if counts else 0
    return best if best > 0 else None


SINFO_TIMEOUT = 10.0


def sinfo_cpus(hosts: Sequence[str]) -> int | None:
    """The smallest CPU count ``sinfo`` reports for ``hosts``, or ``None`` when sinfo cannot tell."""
    try:
        p = subprocess.run(
            ["sinfo", "--noheader", "--Node", f"--nodes={','.join(hosts)}", "--format=%c"],
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(x) for x in p.stdout.split() if x.isdigit()]
    return min(counts) if p.returncode == 0 and counts and min(counts) > 0 else None


def agent_cpu_args(
    env: Mapping[str, str], hosts: Sequence[str], lookup: Callable[[Sequence[str]], int | None] | None = None
) -> list[str]:
    """srun options giving each agent task every CPU it may have on its node (see the module docstring).

    ``lookup`` gives the nodes' CPU count outside an allocation (default :func:`sinfo_cpus`).
    """
    if env.get("SLURM_JOB_ID"):
        cpus = allocated_cpus(env)
        return ["--cpu-bind=none", *([f"--cpus-per-task={cpus}"] if cpus else [])]
    cpus = (lookup or sinfo_cpus)(hosts)
    return ["--cpu-bind=none", "--exclusive", *([f"--cpus-per-task={cpus}"] if cpus else [])]


class SlurmBackend(LauncherBackend):
    """One ``srun`` step starting one agent per node (or every rank, in per-rank mode)."""

    name = "slurm"
    required_programs = ("srun",)
    options = (PER_RANK,)

    def commands(self, plan: LaunchPlan) -> list[Command]:
        check_plan(plan, self.name)
        n = len(plan.nodes)
        argv = ["srun", f"--nodelist={','.join(x.host for x in plan.nodes)}", f"--nodes={n}"]
        if per_rank(plan):
            k = uniform_slots(plan, self.name)
            argv += [f"--ntasks-per-node={k}", f"--ntasks={n * k}"]
            prog = rankenv_argv(plan, node_host_env=NODE_NAME_VAR)
        else:
            argv += ["--ntasks-per-node=1", f"--ntasks={n}", *agent_cpu_args(os.environ, [x.host for x in plan.nodes])]
            prog = plan.agent_argv(["--node-host-env", NODE_NAME_VAR])
        argv += ["--export=ALL", f"--chdir={plan.cwd}"]
        return [Command(argv=(*argv, *plan.launcher_args, *prog), env=job_env(plan))]
