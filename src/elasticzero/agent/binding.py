"""Slot and core binding, and the environment elasticzero adds to torch's worker environment.

Pure functions: the agent plan (:mod:`elasticzero.agent.plan`) calls them with the facts probed before planning; the
agent's start hook adds :func:`worker_env` to each worker's environment (never to the agent's own ``os.environ``);
the exec shim (:mod:`elasticzero.agent.shim`) applies the binding inside each worker before it execs the user's
program.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from elasticzero.proc import AGENT_PID_ENV, JOB_ID_ENV

#: environment names elasticzero sets for every worker (and JOB_ID_ENV, AGENT_PID_ENV: see elasticzero.proc)
CPUS_ENV = "ELASTICZERO_CPUS"  # this worker's cores, comma-joined (set only with --bind-cores-to-rank)


def visible_devices(slots: Sequence[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a node: all its slots, comma-joined (DeepSpeed style; LOCAL_RANK indexes it)."""
    return ",".join(str(s) for s in slots)


def split_cores(cores: Sequence[int], nproc: int) -> list[list[int]]:
    """Split ``cores`` into ``nproc`` contiguous, disjoint, equal chunks (DeepSpeed's ``--bind_cores_to_rank``).

    Leftover cores (``len(cores) % nproc``) stay unused. With fewer cores than ranks, ranks share cores
    round-robin (one core each) rather than fail: oversubscription is the user's choice.
    """
    if nproc <= 0:
        raise ValueError("nproc must be positive")
    cores = sorted(cores)
    if not cores:
        raise ValueError("no cores to bind")
    per = len(cores) // nproc
    if per == 0:
        return [[cores[i % len(cores)]] for i in range(nproc)]
    return [cores[i * per : (i + 1) * per] for i in range(nproc)]


def format_cores(cores: Sequence[int]) -> str:
    """Encode one worker's cores for :data:`CPUS_ENV`: ``"0,1"``."""
    return ",".join(str(c) for c in cores)


def parse_cores(text: str) -> list[int]:
    """Inverse of :func:`format_cores`."""
    return [int(c) for c in text.split(",") if c]


def node_env(job_id: str, agent_pid: int) -> dict[str, str]:
    """What every worker of this agent carries: its job (``--kill-job``'s scope) and its agent (the cleanup scope)."""
    return {JOB_ID_ENV: job_id, AGENT_PID_ENV: str(agent_pid)}


def worker_env(
    base: Mapping[str, str],
    local_rank: int,
    devices: Sequence[int] | None,
    cpus: Sequence[Sequence[int]] | None,
    virtual_local_rank: bool,
) -> dict[str, str]:
    """What elasticzero adds to torch's environment of local rank ``local_rank``: ``base`` (:func:`node_env`, …) plus
    its devices and cores. The agent's start hook applies it.

    ``CUDA_VISIBLE_DEVICES`` = the node's slots, comma-joined (``LOCAL_RANK`` indexes into them, DeepSpeed style), or
    with ``--virtual-local-rank`` only this rank's slot (torch's rule there, applied to the slots instead of the
    agent's own ``CUDA_VISIBLE_DEVICES``); :data:`CPUS_ENV` = this rank's cores.
    """
    env = dict(base)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(devices[local_rank]) if virtual_local_rank else visible_devices(devices)
    if cpus is not None:
        env[CPUS_ENV] = format_cores(cpus[local_rank])
    return env


def worker_extra_env(env: Mapping[str, str]) -> dict[str, str]:
    """DeepSpeed's extra worker variables, derived from the ones torch set for this round.

    ``LOCAL_SIZE`` = local world size, ``CROSS_RANK`` = this node's group rank in the current rendezvous round
    (equal to the node-table rank when the rendezvous honours ``node_rank_hint``), ``CROSS_SIZE`` = number of
    nodes. With core binding, ``OMP_NUM_THREADS`` = the number of cores bound to this rank (as DeepSpeed does).
    """
    out: dict[str, str] = {}
    if "LOCAL_WORLD_SIZE" in env:
        out["LOCAL_SIZE"] = env["LOCAL_WORLD_SIZE"]
    if "GROUP_RANK" in env:
        out["CROSS_RANK"] = env["GROUP_RANK"]
    if "GROUP_WORLD_SIZE" in env:
        out["CROSS_SIZE"] = env["GROUP_WORLD_SIZE"]
    cores = cores_for_worker(env)
    if cores is not None:
        out["OMP_NUM_THREADS"] = str(len(cores))
    return out


def cores_for_worker(env: Mapping[str, str]) -> list[int] | None:
    """The cores this worker is bound to (:data:`CPUS_ENV`), or ``None``."""
    cores = env.get(CPUS_ENV)
    return parse_cores(cores) if cores else None


#: the exec shim's entry, run without ``site`` (``python -S``): argv[1] is the directory holding the elasticzero package
SHIM_STUB = (
    "import sys; sys.path.append(sys.argv[1]); from elasticzero.agent.shim import main; sys.exit(main(sys.argv[2:]))"
)


def package_root() -> str:
    """The directory holding the ``elasticzero`` package this process imported (what :func:`shim_argv` needs)."""
    import elasticzero

    return os.path.dirname(os.path.dirname(os.path.abspath(elasticzero.__file__)))


def shim_argv(python: str, entrypoint: str, args: Sequence[str], root: str) -> tuple[str, list[str]]:
    """Wrap a worker command in the exec shim: ``python -S -c SHIM_STUB root -- entrypoint *args``.

    The shim imports only the standard library and elasticzero, so it skips ``site`` (``-S``: no site-packages,
    ``.pth`` files or editable-install finders to load — most of a bare interpreter's start-up) and finds the package
    at ``root`` (:func:`package_root`), appended after the standard library. The command it execs starts normally.
    """
    return python, ["-S", "-c", SHIM_STUB, root, "--", entrypoint, *args]
