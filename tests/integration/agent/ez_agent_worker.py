"""Tiny gloo worker for the agent tests: ``ez_agent_worker.py OUT_DIR [key=value ...]``.

Writes ``OUT_DIR/report.<pid>.json`` (rank, world size, env, allowed cpus) after one all_reduce. Options:
``loop=1`` keep all-reducing every 0.1 s until ``OUT_DIR/stop`` exists (all ranks stop together; with
``exit_spread=S`` each then waits a random 0..S seconds before it leaves the group and exits 0);
``idle=1`` wait for ``OUT_DIR/stop`` without any collective;
``fail_rank=R fail_code=C`` rank R exits with C after the first all_reduce (via torch's ``@record`` when
``record=1``, raising so an error file is written), ``fail_delay=S`` seconds later, writing ``OUT_DIR/failed_at.R``
(wall-clock time) just before; ``grandchild=1`` start a ``sleep`` in its own session first; ``hang_rank=R`` after the
first all_reduce rank R never joins another collective (it waits for ``OUT_DIR/stop``) while the others all_reduce,
writing ``OUT_DIR/collective.<rank>.json`` (``entered``, and ``failed`` + ``error`` when the collective raised).
The group is set up by ``elasticzero.init_distributed`` (the launcher's collective timeout applies).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from elasticzero.device import init_distributed

ENV_KEYS = (
    "RANK LOCAL_RANK WORLD_SIZE GROUP_RANK LOCAL_SIZE CROSS_RANK CROSS_SIZE CUDA_VISIBLE_DEVICES "
    "ELASTICZERO_JOB_ID OMP_NUM_THREADS TORCHELASTIC_RESTART_COUNT MASTER_ADDR"
).split()


def allowed_cpus() -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return ""


@record
def main() -> None:
    out = Path(sys.argv[1])
    opts = dict(a.split("=", 1) for a in sys.argv[2:])
    grandchild = None
    if opts.get("grandchild") == "1":
        grandchild = subprocess.Popen(["sleep", "600"], start_new_session=True).pid
    init_distributed()
    rank = dist.get_rank()
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    report = {
        "pid": os.getpid(),
        "rank": rank,
        "world_size": dist.get_world_size(),
        "sum": t.item(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "cpus": allowed_cpus(),
        "grandchild": grandchild,
        "time": time.time(),
        "started": psutil.Process().create_time(),  # this process's start: time - started is its start-up
    }
    tmp = out / f".report.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out / f"report.{os.getpid()}.json")
    print(f"hello from rank {rank}", flush=True)
    if "fail_rank" in opts and int(opts["fail_rank"]) == rank:
        time.sleep(float(opts.get("fail_delay", "0")))
        (out / f"failed_at.{rank}").write_text(str(time.time()))
        if opts.get("record") == "1":
            raise RuntimeError(f"deliberate failure of rank {rank}")
        sys.exit(int(opts.get("fail_code", "3")))
    if "hang_rank" in opts:
        collective_with_a_missing_peer(out, rank, int(opts["hang_rank"]))
    if opts.get("idle") == "1":  # no collectives: only the agents can tell this worker about a failure
        while not (out / "stop").exists():
            time.sleep(0.1)
    if opts.get("loop") == "1":
        flag = torch.zeros(1)
        while True:
            flag.fill_(1.0 if (out / "stop").exists() else 0.0)
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
            time.sleep(0.1)
        time.sleep(random.uniform(0, float(opts.get("exit_spread", "0"))))
    dist.destroy_process_group()


def collective_with_a_missing_peer(out: Path, rank: int, hang_rank: int) -> None:
    """Rank ``hang_rank`` stays out of the collective the others enter; they record when it failed and re-raise."""
    if rank == hang_rank:
        while not (out / "stop").exists():
            time.sleep(0.1)
        return
    record_ = {"entered": time.time()}
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:
        record_ |= {"failed": time.time(), "error": str(exc)}
        raise
    finally:
        (out / f"collective.{rank}.json").write_text(json.dumps(record_))


if __name__ == "__main__":
    main()
