"""Resource discovery: where the pool of hosts and slots comes from, before filters.

In order:

1. ``--hostfile PATH`` given: that file (missing → error, never a fallback to localhost).
2. ``$ELASTICZERO_HOSTFILE`` set: that file, same rules (a path the user chose on purpose).
3. the default path ``/job/hostfile`` (DeepSpeed's) exists: that file.
4. inside a Slurm allocation (``SLURM_JOB_NODELIST``): the allocation's nodes; slots per node are
   ``SLURM_GPUS_ON_NODE`` when GPUs were allocated (assumed the same on every node), else ``--nproc-per-node``,
   else ``SLURM_TASKS_PER_NODE``, else 1.
5. localhost: the visible accelerators (``torch.cuda.device_count()``; the ids listed in an existing
   ``CUDA_VISIBLE_DEVICES`` become the slot ids), or on CPU ``--nproc-per-node`` processes (default 1).

Then :func:`select_pool` applies the filters (``-i``/``-e``, then ``--num-nodes``/``--num-gpus``): the pool
``elasticzero-launch`` plans on and the autotuner schedules trials on, by one rule.

The decisions are pure functions of the environment mapping; only :func:`detect_gpu_count` and the hostfile read
touch the machine.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elasticzero.errors import UsageError
from elasticzero.launch.filters import apply_filters, select_first
from elasticzero.launch.hostfile import ResourcePool, host_key, host_problem, normalize_host, read_hostfile
from elasticzero.launch.hostlist import expand_counts, expand_hostlist

if TYPE_CHECKING:
    import argparse

DEFAULT_HOSTFILE = "/job/hostfile"
HOSTFILE_ENV = "ELASTICZERO_HOSTFILE"
LOCALHOST = "localhost"


@dataclass(frozen=True)
class Discovery:
    """The discovered pool and where it came from (``source`` is used in messages)."""

    pool: ResourcePool
    kind: str  # "hostfile" | "slurm" | "local"
    source: str


def detect_gpu_count() -> int:
    """Visible CUDA/ROCm devices, without creating a CUDA context; 0 on machines without GPU device nodes.

    ``torch`` is imported only when a GPU device node exists, so CPU launches stay fast.
    """
    if not glob.glob("/dev/nvidia[0-9]*") and not Path("/dev/kfd").exists():
        return 0
    import torch

    return int(torch.cuda.device_count())


def discover(
    hostfile: str | None,
    env: Mapping[str, str],
    nproc_per_node: int | None = None,
    detect_gpus: Callable[[], int] | None = None,
    default_hostfile: str | None = None,
) -> Discovery:
    """Find the resource pool (see the module docstring for the order).

    ``detect_gpus`` defaults to :func:`detect_gpu_count`, ``default_hostfile`` to :data:`DEFAULT_HOSTFILE`.
    """
    default_hostfile = default_hostfile or DEFAULT_HOSTFILE
    detect_gpus = detect_gpus or detect_gpu_count
    explicit = hostfile or env.get(HOSTFILE_ENV) or None
    if explicit is not None:
        return Discovery(read_hostfile(explicit), "hostfile", f"hostfile {explicit}")
    if Path(default_hostfile).is_file():
        return Discovery(read_hostfile(default_hostfile), "hostfile", f"hostfile {default_hostfile}")
    if env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"):
        return Discovery(slurm_pool(env, nproc_per_node), "slurm", "Slurm allocation")
    return Discovery(local_pool(env, detect_gpus(), nproc_per_node), "local", "localhost")


def select_pool(
    args: argparse.Namespace, env: Mapping[str, str], detect_gpus: Callable[[], int] | None = None
) -> ResourcePool:
    """Discovery, then ``-i``/``-e``, then ``--num-nodes``/``--num-gpus``.

    ``args`` holds the launcher's parsed flags (``hostfile``, ``include``, ``exclude``, ``num_nodes``,
    ``num_gpus``); ``elasticzero-launch`` and ``elasticzero-autotune`` parse them alike.
    """
    found = discover(args.hostfile, env, args.num_gpus, detect_gpus)
    pool = apply_filters(found.pool, args.include, args.exclude, found.source)
    return select_first(pool, args.num_nodes, args.num_gpus, found.source)


def local_pool(env: Mapping[str, str], gpu_count: int, nproc_per_node: int | None) -> ResourcePool:
    """Localhost's slots: the visible GPUs (ids from ``CUDA_VISIBLE_DEVICES`` if set), else ``nproc_per_node``."""
    if gpu_count <= 0:
        n = 1 if nproc_per_node is None else nproc_per_node
        if n < 1:
            raise UsageError(f"--nproc-per-node {n} must be at least 1")
        return {LOCALHOST: tuple(range(n))}
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return {LOCALHOST: tuple(range(gpu_count))}
    items = [x.strip() for x in visible.split(",")]
    if not all(x.isdigit() and x.isascii() for x in items):
        raise UsageError(
            f"CUDA_VISIBLE_DEVICES={visible!r} lists non-numeric devices; elasticzero binds slots by index, "
            "so list indices (e.g. 0,1) or use a hostfile"
        )
    return {LOCALHOST: tuple(int(x) for x in items[:gpu_count])}


def slurm_pool(env: Mapping[str, str], nproc_per_node: int | None) -> ResourcePool:
    """The pool of the Slurm allocation described by ``env``."""
    var = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodes = expand_hostlist(env[var], var)
    seen: set[str] = set()
    for node in nodes:
        if normalize_host(node) is None:
            raise UsageError(f"{var}: {host_problem(node)}")
        if host_key(node) in seen:  # compared like hostfile hosts: case-insensitively
            raise UsageError(f"{var}={env[var]!r}: node {node!r} listed twice")
        seen.add(host_key(node))
    counts = _slurm_counts(env, len(nodes), nproc_per_node)
    return {node: tuple(range(c)) for node, c in zip(nodes, counts, strict=True)}


def _slurm_counts(env: Mapping[str, str], n_nodes: int, nproc_per_node: int | None) -> list[int]:
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus:
        if not gpus.isdigit():
            raise UsageError(f"SLURM_GPUS_ON_NODE={gpus!r} is not a number")
        if int(gpus) > 0:
            return [int(gpus)] * n_nodes
    if nproc_per_node is not None:
        if nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {nproc_per_node} must be at least 1")
        return [nproc_per_node] * n_nodes
    tasks = env.get("SLURM_TASKS_PER_NODE", "").strip()
    if not tasks:
        return [1] * n_nodes
    counts = expand_counts(tasks)
    if len(counts) != n_nodes:
        raise UsageError(
            f"SLURM_TASKS_PER_NODE={tasks!r} gives {len(counts)} counts for {n_nodes} nodes in the allocation"
        )
    if any(c < 1 for c in counts):
        raise UsageError(f"SLURM_TASKS_PER_NODE={tasks!r} has a zero count")
    return counts
