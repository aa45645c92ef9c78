"""MVAPICH2: the ``mpirun_rsh`` shape, or its hydra ``mpiexec`` flavour.

``mpirun_rsh`` (default, ``mvapich_launcher="mpirun_rsh"``)::

    mpirun_rsh -export -np N h1 h2 … <agent>            # agent mode: one rank per host
    mpirun_rsh -export -np N h1 h1 h2 h2 … <rankenv>    # per-rank mode: each host repeated per slot

Hosts go on the command line (no hostfile to write); ``-export`` forwards the launcher's environment, so the
exported values travel in the command's own environment and never as ``VAR=VAL`` words on the argv. Agents find
their node from ``MV2_COMM_WORLD_RANK``.

``mpirun_rsh`` is a remote-shell boundary: it formats ``cd WD; env … MPISPAWN_ARGV_i=<arg> … mpispawn`` with plain
``%s`` and hands that string to ``ssh host`` (or ``bash -c`` locally), so every element of the program argv is
passed through :func:`shlex.quote` here (it crosses exactly one shell). mpirun_rsh puts its own working directory
(the plan's cwd, where :func:`elasticzero.launch.execute.execute` starts it) into that string unquoted, so a cwd
that would need quoting is rejected. The hydra flavour passes argv verbatim and is not quoted.

No Debian package of MVAPICH exists, so this shape is only unit-tested here. MVAPICH2's ``mpiexec`` is hydra:
``mvapich_launcher="hydra"`` builds the MPICH command (``-genvlist``, ``PMI_RANK``) with ``mpiexec`` (override
with the ``mpiexec`` option), and that path runs for real through MPICH's hydra in the tests.
"""

from __future__ import annotations

import shlex
import shutil
from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.backend import BackendOption, Command, LauncherBackend
from elasticzero_plugins._common import PER_RANK, check_plan, job_env, per_rank, rankenv_argv
from elasticzero_plugins.mpich import hydra_command

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan


class MVAPICHBackend(LauncherBackend):
    """``mpirun_rsh`` (default) or hydra ``mpiexec`` starting one agent per host, or every rank."""

    name = "mvapich"
    options = (
        PER_RANK,
        BackendOption(
            "mvapich_launcher", str, "mpirun_rsh", "which MVAPICH2 starter to use", choices=("mpirun_rsh", "hydra")
        ),
        BackendOption("mpiexec", str, "mpiexec", "the hydra mpiexec program (mvapich_launcher=hydra)"),
    )

    def check_available(self) -> None:
        """Needs ``mpirun_rsh`` or a hydra ``mpiexec``/``mpiexec.hydra`` on PATH."""
        if not any(shutil.which(p) for p in ("mpirun_rsh", "mpiexec", "mpiexec.hydra")):
            raise UsageError("launcher 'mvapich' needs 'mpirun_rsh' (or MVAPICH2's hydra 'mpiexec') on PATH")

    def commands(self, plan: LaunchPlan) -> list[Command]:
        if plan.options["mvapich_launcher"] == "hydra":
            return [hydra_command(plan, plan.options["mpiexec"], self.name)]
        check_plan(plan, self.name)
        if per_rank(plan):
            hosts = [n.host for n in plan.nodes for _ in n.slots]
            prog = rankenv_argv(plan)
        else:
            hosts = [n.host for n in plan.nodes]
            prog = plan.agent_argv(["--node-rank-env", "MV2_COMM_WORLD_RANK"])
        check_rsh_cwd(plan.cwd)
        argv = ["mpirun_rsh", "-export", "-np", str(len(hosts)), *hosts, *plan.launcher_args]
        return [Command(argv=(*argv, *rsh_quote(prog)), env=job_env(plan))]


def rsh_quote(prog: list[str]) -> list[str]:
    """The program argv for ``mpirun_rsh``: each element quoted for the one remote shell it crosses.

    mpirun_rsh pastes each argument unquoted into ``MPISPAWN_ARGV_i=%s`` of the string ssh runs; after that
    shell's parse, ``mpispawn`` gets exactly the original bytes.
    """
    return [shlex.quote(a) for a in prog]


def check_rsh_cwd(cwd: str) -> None:
    """Reject a working directory mpirun_rsh would break (it writes its cwd into ``cd %s`` unquoted)."""
    if shlex.quote(cwd) != cwd:
        raise UsageError(
            f"launcher 'mvapich' (mpirun_rsh) cannot start in {cwd!r}: mpirun_rsh passes its working directory "
            "through the remote shell unquoted; run from a directory whose path has only letters, digits and "
            "'@%+=:,./-_', or use mvapich_launcher='hydra'"
        )
