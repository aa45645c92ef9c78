"""Reduce-scatter and all-gather on gloo (CPU): gloo's own collectives vs elasticzero's ring, side by side.

    .venv/bin/python bench/collectives_bench.py [--world-size 2] [--mib 25] [--reps 8]

Spawns ``--world-size`` gloo ranks on 127.0.0.1 (one torch thread each); every rank times each variant on the same
fp32 buffer (``--mib`` MiB, the engine's default bucket), alternating variants, and rank 0 prints the median ms per
call and the ratios. An all-reduce of the same buffer is printed for scale (it moves twice the data). Not a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from elasticzero.engine.zero import ring
from ez_ports import free_port  # tests/ on sys.path: the one free-port rule of tests and benchmarks


def _rank(rank: int, world: int, port: int, mib: float, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = int(mib * 2**20 / 4) // world * world
    x = torch.randn(n)
    shard, full = torch.empty(n // world), torch.empty(n)
    group = dist.group.WORLD

    tags = itertools.count()  # every rank runs the same sequence of rings

    def keep(_: tuple[torch.Tensor, ...]) -> None:
        return None

    def tag() -> int:
        return ring.message_tag(next(tags))

    variants: dict[str, Callable[[], None]] = {
        "gloo reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, x),
        "ring reduce_scatter": lambda: ring.reduce_scatter(shard, x, group, tag(), keep).wait(),
        "gloo all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "ring all_gather": lambda: ring.all_gather(full, shard, group, tag(), keep).wait(),
        "gloo all_reduce": lambda: dist.all_reduce(x),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for f in variants.values():
        f()  # warm-up
    for _ in range(reps):
        for name, f in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1000)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"world={world} buffer={n * 4 / 2**20:.1f} MiB fp32 reps={reps} load={os.getloadavg()[0]:.2f}")
        for k, v in med.items():
            print(f"  {k:22s} {v:8.1f} ms  [{min(times[k]):.1f}-{max(times[k]):.1f}]")
        print(f"  ring/gloo reduce_scatter: {med['ring reduce_scatter'] / med['gloo reduce_scatter']:.2f}")
        print(f"  ring/gloo all_gather:     {med['ring all_gather'] / med['gloo all_gather']:.2f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mib", type=float, default=25.0)
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    port = free_port()
    mp.spawn(_rank, args=(a.world_size, port, a.mib, a.reps), nprocs=a.world_size, join=True)


if __name__ == "__main__":
    main()
