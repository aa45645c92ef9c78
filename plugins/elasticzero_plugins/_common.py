"""Pieces shared by the shipped backends: input validation, job tagging, the per-rank option and argv.

Each backend declares its options on its class (:attr:`elasticzero.launch.backend.LauncherBackend.options`);
:data:`PER_RANK` is the one shared by the MPI and Slurm backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.backend import BackendOption
from elasticzero.launch.envexport import KEY as ENV_NAME
from elasticzero.launch.hostfile import HOST_NAME
from elasticzero.proc import JOB_ID_ENV, check_job_id

if TYPE_CHECKING:
    from elasticzero.launch.plan import LaunchPlan


def check_host(host: str, backend: str) -> None:
    """Reject a host name a transport could misread (option, list separator, range, shell syntax).

    Accepted: DNS-style names and IPv4 addresses (letters, digits, ``.``, ``-``, ``_``; no leading ``-``).
    Rejected: ``user@host`` (put the user in ~/.ssh/config) and IPv6 literals (``-w``/``-H``/``--nodelist``
    lists give ``:`` its own meaning; use a name from /etc/hosts instead). The hostfile refuses both already, with
    the file and line (:mod:`elasticzero.launch.hostfile`); this check covers hosts from any other source.
    """
    if not HOST_NAME.fullmatch(host):
        raise UsageError(
            f"launcher {backend!r}: host name {host!r} is not usable (allowed: letters, digits, '.', '-', '_'; "
            "no user@ part, no IPv6 literal: use a name from /etc/hosts or ~/.ssh/config)"
        )


def check_plan(plan: LaunchPlan, backend: str) -> None:
    """Validate host names, env names and the job id before any transport argv is built."""
    if not plan.nodes:
        raise UsageError(f"launcher {backend!r}: the plan has no nodes")
    for node in plan.nodes:
        check_host(node.host, backend)
    for name in plan.env:
        if not ENV_NAME.fullmatch(name):
            raise UsageError(f"launcher {backend!r}: invalid environment variable name {name!r}")
    check_job_id(plan.job_id, f"launcher {backend!r}: job id")


def job_env(plan: LaunchPlan) -> dict[str, str]:
    """The environment every started process gets: the exported env plus the job tag (cleanup is scoped by it)."""
    return {**plan.env, JOB_ID_ENV: plan.job_id}


#: the scheduler owns every rank (openmpi, mpich, mvapich, slurm): ranks start ``rankenv`` directly, no agent
PER_RANK = BackendOption(
    "per_rank", bool, False, "the scheduler starts every rank directly (no agent)", flag="--per-rank"
)


def per_rank(plan: LaunchPlan) -> bool:
    """Whether the plan asks for per-rank mode (the scheduler starts every rank)."""
    return bool(plan.options.get("per_rank", False))


def uniform_slots(plan: LaunchPlan, backend: str) -> int:
    """The common slot count per node; per-rank mode with this backend needs the same count everywhere."""
    counts = {len(n.slots) for n in plan.nodes}
    if len(counts) != 1:
        raise UsageError(
            f"launcher {backend!r} in per-rank mode needs the same number of slots on every node "
            f"(got {sorted(counts)}); use the agent mode (drop --per-rank) or even out the hostfile"
        )
    return counts.pop()


def rankenv_argv(plan: LaunchPlan, *, node_host_env: str | None = None) -> list[str]:
    """The argv of one rank in per-rank mode: ``python -m elasticzero.launch.rankenv … -- <entry>``.

    The node table lets each rank find its node's slots (``CUDA_VISIBLE_DEVICES``) and its rank in hostfile
    order: by the node name in ``node_host_env`` when given, else from the transport's block layout.
    """
    a = plan.agent
    if a.rdzv_endpoint:
        raise UsageError(
            f"--rdzv-endpoint {a.rdzv_endpoint}: per-rank mode starts every rank without an agent, so there is no "
            "rendezvous to point there; drop --per-rank (or --rdzv-endpoint)"
        )
    argv = [a.python, "-u", "-m", "elasticzero.launch.rankenv", "--node-table", plan.node_table_json()]
    if node_host_env:
        argv += ["--node-host-env", node_host_env]
    argv += ["--master-addr", plan.master_addr, "--master-port", str(plan.master_port)]
    if a.module:
        argv.append("--module")
    if a.no_python:
        argv.append("--no-python")
    return [*argv, "--", *plan.entry]
