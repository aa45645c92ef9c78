"""Per-rank mode: map a scheduler's rank variables to torch's, then run the user's program.

``python -m elasticzero.launch.rankenv [--node-table JSON [--node-host-env VAR]] --master-addr A --master-port P
[--module | --no-python] -- ENTRY…`` is what every rank runs when the scheduler (mpirun, mpiexec, srun) owns the
ranks. It reads the first of these variable families that is present:

==========  ======================  ======================  ===========================  ===========================
family      rank                    world size              local rank                   local world size
==========  ======================  ======================  ===========================  ===========================
OpenMPI     OMPI_COMM_WORLD_RANK    OMPI_COMM_WORLD_SIZE    OMPI_COMM_WORLD_LOCAL_RANK   OMPI_COMM_WORLD_LOCAL_SIZE
MVAPICH     MV2_COMM_WORLD_RANK     MV2_COMM_WORLD_SIZE     MV2_COMM_WORLD_LOCAL_RANK    MV2_COMM_WORLD_LOCAL_SIZE
PMI/hydra   PMI_RANK                PMI_SIZE                MPI_LOCALRANKID              MPI_LOCALNRANKS
Slurm       SLURM_PROCID            SLURM_NTASKS            SLURM_LOCALID                (from the node table)
==========  ======================  ======================  ===========================  ===========================

and sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. With ``--node-table`` (``[[host, [slot, …]], …]`` in hostfile order) ranks
follow hostfile order and ``CUDA_VISIBLE_DEVICES`` is set to the node's slots: the node is the row named by
``$VAR`` (``--node-host-env``), or else the row whose block of ranks holds the transport's rank.

The program runs as a child (not ``exec``) so that a worker killed by a signal is reported as ``128+signal``
by every transport (hydra would otherwise report the bare signal number); signals are forwarded to it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticzero.errors import UsageError, cli_main
from elasticzero.proc import exit_status, parent_death_preexec

PROG = "python -m elasticzero.launch.rankenv"
FAMILIES: tuple[tuple[str, str, str, str, str | None], ...] = (
    (
        "OpenMPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: global and node-local rank and sizes, its node index and the node's slots."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    nnodes: int
    slots: tuple[int, ...] | None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise UsageError(f"${name} is missing or not an integer") from None


def resolve(
    env: Mapping[str, str], table: Sequence[tuple[str, Sequence[int]]] | None = None, node_host_env: str | None = None
) -> RankInfo:
    """Compute a rank's place from the transport's variables (pure: ``env`` is a mapping, nothing is read)."""
    fam = next((f for f in FAMILIES if f[1] in env), None)
    if fam is None:
        names = ", ".join(f[1] for f in FAMILIES)
        raise UsageError(f"no scheduler rank variable found (looked for {names})")
    _, v_rank, v_size, v_local, v_lsize = fam
    t_rank, t_size, t_local = _int(env, v_rank), _int(env, v_size), _int(env, v_local)
    if not table:
        lsize = _int(env, v_lsize) if v_lsize else 1
        return RankInfo(t_rank, t_size, t_local, lsize, 0, 1, None)
    starts: list[int] = []
    acc = 0
    for _, node_slots in table:
        starts.append(acc)
        acc += len(node_slots)
    if acc != t_size:
        raise UsageError(f"the node table has {acc} slots but the scheduler started {t_size} ranks")
    if node_host_env:
        host = env.get(node_host_env, "")
        hosts = [h for h, _ in table]
        short = [h.split(".")[0] for h in hosts]
        if host in hosts:
            node = hosts.index(host)
        elif host.split(".")[0] in short:
            node = short.index(host.split(".")[0])
        else:
            raise UsageError(f"${node_host_env}={host!r} is not a host of the node table {hosts}")
        local = t_local
    else:
        node = max(i for i, s in enumerate(starts) if s <= t_rank)
        local = t_rank - starts[node]
        if local != t_local:
            raise UsageError(
                f"rank {t_rank} has local rank {t_local}, expected {local}: "
                "the scheduler did not place ranks in hostfile-order blocks"
            )
    slots = tuple(int(s) for s in table[node][1])
    if local >= len(slots):
        raise UsageError(f"local rank {local} but node {table[node][0]!r} has {len(slots)} slots")
    return RankInfo(starts[node] + local, acc, local, len(slots), node, len(table), slots)


def torch_env(info: RankInfo, master_addr: str | None, master_port: int | None) -> dict[str, str]:
    """The torch.distributed variables for ``info``."""
    env = {
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_world_size),
        "GROUP_RANK": str(info.node),
        "GROUP_WORLD_SIZE": str(info.nnodes),
        "ROLE_RANK": str(info.rank),
        "ROLE_WORLD_SIZE": str(info.world_size),
    }
    if info.slots is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in info.slots)
    if master_addr:
        env["MASTER_ADDR"] = master_addr
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    return env


def run_child(argv: list[str], env: dict[str, str]) -> int:
    """Run the program, forwarding signals; return its code, or ``128+signal`` when a signal killed it.

    The forwarding handlers are installed before the child starts: a signal that arrives while it is being
    started is held and delivered to it right after, instead of killing this wrapper (and, through the
    parent-death signal, the child) with a misleading status.
    """
    held: list[int] = []
    started: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        if not started:
            held.append(signum)
            return
        try:
            started[0].send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        # the child gets SIGKILL when this wrapper dies
        started.append(subprocess.Popen(argv, env=env, preexec_fn=parent_death_preexec(signal.SIGKILL, os.getpid())))
        while held:
            forward(held.pop(0), None)
        rc = started[0].wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return exit_status(rc)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description="Per-rank mode: scheduler rank variables → torch's.")
    ap.add_argument("--node-table", help="JSON [[host, [slot, …]], …] in hostfile order")
    ap.add_argument("--node-host-env", help="variable naming this rank's node (e.g. SLURMD_NODENAME)")
    ap.add_argument("--master-addr")
    ap.add_argument("--master-port", type=int)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--module", action="store_true", help="ENTRY is a module (python -m)")
    mode.add_argument("--no-python", action="store_true", help="ENTRY is a program, not a python script")
    ap.add_argument("entry", nargs=argparse.REMAINDER)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; see the module docstring."""

    def _main(a: Sequence[str] | None) -> int:
        args = _parse(a)
        entry = list(args.entry)
        if entry and entry[0] == "--":
            entry = entry[1:]
        if not entry:
            raise UsageError("nothing to run (give the script after --)")
        table = json.loads(args.node_table) if args.node_table else None
        info = resolve(os.environ, table, args.node_host_env)
        env = {**os.environ, **torch_env(info, args.master_addr, args.master_port)}
        if args.no_python:
            cmd = entry
        elif args.module:
            cmd = [sys.executable, "-u", "-m", *entry]
        else:
            cmd = [sys.executable, "-u", *entry]
        return run_child(cmd, env)

    return cli_main(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
