"""Where a checkpoint load's time goes: ``Checkpointer.load_latest`` of a 2-rank checkpoint into ``ZeroStage3`` at
world size 1 (one process), each load into a freshly built optimizer, the last one under ``cProfile``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_bench.py --no-deepspeed --dir /tmp/ckb   # writes the files
    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_load_profile.py /tmp/ckb/ours_sync

Prints every load's seconds, their median, the machine load and the profile's top entries by own time (the
``preadv`` line is the reading, page faults of the new buffers included). Not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="a Checkpointer directory (checkpoint_bench.py --dir D: D/ours_sync)")
    p.add_argument("--size", default="bench", help="GPT size it was saved with (default bench)")
    p.add_argument("--loads", type=int, default=5, help="loads, the last one profiled (default 5)")
    p.add_argument("--no-verify", action="store_true", help="verify_on_load=False")
    p.add_argument("--top", type=int, default=15, help="profile entries printed (default 15)")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29613"))
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, config_for  # noqa: I001 (examples/ on sys.path)
    from elasticzero.checkpoint import Checkpointer
    from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
    from elasticzero.engine.zero.stage3 import ZeroStage3

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = config_for(args.size, block_size=max(64, config_for(args.size).block_size))
    ckpt = Checkpointer(args.directory, verify_on_load=not args.no_verify, read_only=True)
    times, prof = [], cProfile.Profile()
    for i in range(args.loads):
        torch.manual_seed(1)
        state = {"zero": ZeroCheckpointState(ZeroStage3(GPT(cfg), torch.optim.AdamW, lr=1e-4))}
        last = i == args.loads - 1
        t0 = time.perf_counter()
        if last:
            prof.enable()
        ckpt.load_latest(state)
        if last:
            prof.disable()
        times.append(time.perf_counter() - t0)
        del state
    print(f"loads (s): {[round(t, 3) for t in times]}, median {statistics.median(times):.3f}")
    print(f"load average: {os.getloadavg()}, cores: {os.cpu_count()}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
