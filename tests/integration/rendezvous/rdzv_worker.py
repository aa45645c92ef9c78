"""Worker script for the torchrun tests: records its env, joins one gloo world, all-reduces, optionally sleeps."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
)


def main() -> int:
    out_dir = sys.argv[1]
    sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"started{dist.get_rank()}"), "w") as f:
        f.write("1")
    time.sleep(sleep_s)
    dist.barrier()
    record = {k: os.environ.get(k) for k in KEYS}
    record["allreduce"] = t.item()
    record["node_addr_hint"] = os.environ.get("EZ_TEST_NODE", "")
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
