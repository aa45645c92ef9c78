"""Test worker: a gloo all_reduce, then a JSON report of what this rank saw, written to $EZ_TEST_OUT/rank-<R>.json.

``EZ_TEST_SLEEP=S``: write ``pid-<RANK>-<pid>`` (content: host name) and sleep S seconds first.
``EZ_TEST_HOLD=PATH``: write ``held-<RANK>`` and wait until PATH exists before going on (the test releases it).
``EZ_TEST_EXIT_RANK=R:CODE`` (R a rank or ``*``; CODE a number or ``KILL``): after the report, exit that way.

Reports go to files, not stdout: transports interleave the lines of several ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time


def main() -> int:
    if os.environ.get("EZ_TEST_HOLD"):
        with open(os.path.join(os.environ["EZ_TEST_OUT"], f"held-{os.environ.get('RANK')}"), "w") as f:
            f.write(socket.gethostname())
        while not os.path.exists(os.environ["EZ_TEST_HOLD"]):
            time.sleep(0.05)  # the test creates the file once it has looked at every process
    if os.environ.get("EZ_TEST_SLEEP"):
        out = os.environ["EZ_TEST_OUT"]
        with open(os.path.join(out, f"pid-{os.environ.get('RANK')}-{os.getpid()}"), "w") as f:
            f.write(socket.gethostname())
        time.sleep(float(os.environ["EZ_TEST_SLEEP"]))
    # torch only once the rank goes on: a rank held or asleep until the test stops it never spends the ~3 s of CPU
    # its import costs (4 ranks a launch on the 2-core CI machine)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    names = [n for n in os.environ if n.startswith("EZT_")]
    report = {
        "host": socket.gethostname(),
        "env": {k: os.environ.get(k) for k in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"]},
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "job": os.environ.get("ELASTICZERO_JOB_ID"),
        "exported": {k: os.environ[k] for k in names},
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "sum": t.item(),
        "dist_world": dist.get_world_size(),
        "dist_rank": dist.get_rank(),
    }
    dist.destroy_process_group()
    with open(os.path.join(os.environ["EZ_TEST_OUT"], f"rank-{report['dist_rank']}.json"), "w") as f:
        json.dump(report, f)
    rank, _, code = os.environ.get("EZ_TEST_EXIT_RANK", "-1:0").partition(":")
    if rank == "*" or int(rank) == report["dist_rank"]:
        if code == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)
        return int(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
