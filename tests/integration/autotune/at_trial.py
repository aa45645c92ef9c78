"""Trial script for the autotuning tests: a tiny model on 2 gloo ranks with a known cost per configuration.

Reads its config (``--config``, native YAML) like any script would. Each micro-batch runs a real forward/backward
of a tiny linear model and then sleeps a fixed cost, so the ranking of configurations is known and far above
timing noise: micro-batch cost ``12 ms + 3 ms x micro + 10 ms x stage``; a step has ``accumulation`` micro-batches.

Behaviour switches (environment, ``STAGE:MICRO``):

* ``EZ_AT_OOM``: raise torch.OutOfMemoryError when stage <= STAGE and micro >= MICRO (the memory model's shape);
* ``EZ_AT_HANG``: at exactly that point, ignore SIGTERM, write ``hanging-<rank>`` and sleep forever;
* ``EZ_AT_NOREPORT``: at exactly that point, exit 0 without writing a report;
* ``EZ_AT_REPORT=direct``: time the loop itself and report latency per micro-batch with ``autotune.report``
  (otherwise ``autotune.measure(timers)`` reports from PhaseTimers).

Every rank prints a line containing "error" to stderr: it must not count as a failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from elasticzero import autotune
from elasticzero.config.load import read_file
from elasticzero.engine.timers import PhaseTimers


def _at(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    if not value:
        return None
    s, m = value.split(":")
    return int(s), int(m)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    cfg = read_file(args.config)
    stage, micro, accum = cfg["zero"]["stage"], cfg["micro_batch_size"], cfg["accumulation_steps"]
    print("error: this stderr line is noise, not a failure", file=sys.stderr, flush=True)
    dist.init_process_group("gloo")
    with autotune.trial():
        oom, hang, noreport = _at("EZ_AT_OOM"), _at("EZ_AT_HANG"), _at("EZ_AT_NOREPORT")
        if oom and stage <= oom[0] and micro >= oom[1]:
            raise torch.OutOfMemoryError(f"injected OOM at stage {stage} micro batch {micro}")
        if hang == (stage, micro):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(f"hanging-{os.environ['RANK']}", "w") as f:  # in the tuner's working directory
                f.write(str(os.getpid()))
            while True:
                time.sleep(3600)
        if noreport == (stage, micro):
            dist.destroy_process_group()
            return 0
        train(stage, micro, accum)
    dist.destroy_process_group()
    return 0


def train(stage: int, micro: int, accum: int) -> None:
    model = torch.nn.Linear(16, 16)
    cost = 0.012 + 0.003 * micro + 0.010 * stage
    timers = PhaseTimers(enabled=True)
    direct = os.environ.get("EZ_AT_REPORT") == "direct"
    if not direct:
        autotune.measure(timers)
    warmup, steps = autotune.window_steps()
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        for _ in range(accum):
            model(torch.randn(micro, 16)).sum().backward()
            time.sleep(cost)
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad = None
        if timers.count(samples=micro * accum):
            return
    per_micro = (time.perf_counter() - started) / (steps * accum)
    autotune.report("ok", {"latency": per_micro, "steps": steps})


if __name__ == "__main__":
    sys.exit(main())
