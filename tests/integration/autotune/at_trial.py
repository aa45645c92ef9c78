"""Trial script for the autotuning tests: 2 ranks with a known cost per configuration.

Reads its config (``--config``, native YAML) like any script would. Each micro-batch sleeps a fixed cost, so the
ranking of configurations is known and far above timing noise: micro-batch cost ``12 ms + 3 ms x micro + 10 ms x
stage``; a step has ``accumulation`` micro-batches.

The trial contract is framework-agnostic, so by default a trial never imports torch (most tests check what the tuner
does with reports, and a torch import per rank per experiment is most of a trial's time on a loaded machine). At the
point named by ``EZ_AT_TORCH`` it is a real torch job: gloo process group, a tiny linear model's forward/backward per
micro-batch, gradients all-reduced, and an injected OOM is torch's ``OutOfMemoryError`` (elsewhere a ``MemoryError``).

Behaviour switches (environment, ``STAGE:MICRO``):

* ``EZ_AT_OOM``: raise an out-of-memory error when stage <= STAGE and micro >= MICRO (the memory model's shape);
* ``EZ_AT_HANG``: at exactly that point, right at start, ignore SIGTERM, write ``hanging-<rank>``, sleep forever;
* ``EZ_AT_NOREPORT``: at exactly that point, exit 0 without writing a report;
* ``EZ_AT_TORCH``: at exactly that point, run as the real torch job described above;
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
from collections.abc import Callable
from types import ModuleType

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
    if _at("EZ_AT_HANG") == (stage, micro):
        hang()
    print("error: this stderr line is noise, not a failure", file=sys.stderr, flush=True)
    real = _at("EZ_AT_TORCH") == (stage, micro)
    with autotune.trial():
        oom = _at("EZ_AT_OOM")
        if oom and stage <= oom[0] and micro >= oom[1]:
            raise (_torch().OutOfMemoryError if real else MemoryError)(f"injected OOM at stage {stage} micro {micro}")
        if _at("EZ_AT_NOREPORT") == (stage, micro):
            return 0
        train(stage, micro, accum, torch_step(micro) if real else None)
    if real:
        _torch().distributed.destroy_process_group()
    return 0


def hang() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(f"hanging-{os.environ['RANK']}", "w") as f:  # in the tuner's working directory
        f.write(str(os.getpid()))
    while True:
        time.sleep(3600)


def _torch() -> ModuleType:  # imported only for the real torch trial
    import torch

    return torch


def torch_step(micro: int) -> Callable[[bool], None]:
    """A real torch job: gloo group, forward/backward per micro-batch, gradients all-reduced at each step's end."""
    torch = _torch()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"real torch trial: gloo world {dist.get_world_size()}", file=sys.stderr, flush=True)
    model = torch.nn.Linear(16, 16)

    def step(last_micro: bool) -> None:
        model(torch.randn(micro, 16)).sum().backward()
        if last_micro:
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad = None

    return step


def train(stage: int, micro: int, accum: int, step: Callable[[bool], None] | None) -> None:
    cost = 0.012 + 0.003 * micro + 0.010 * stage
    timers = PhaseTimers(enabled=True)
    direct = os.environ.get("EZ_AT_REPORT") == "direct"
    if not direct:
        autotune.measure(timers)
    warmup, steps = autotune.window_steps()
    started = 0.0
    for n in range(warmup + steps):
        if n == warmup:
            started = time.perf_counter()
        for i in range(accum):
            if step is not None:
                step(i == accum - 1)
            time.sleep(cost)
        if timers.count(samples=micro * accum):
            return
    per_micro = (time.perf_counter() - started) / (steps * accum)
    autotune.report("ok", {"latency": per_micro, "steps": steps})


if __name__ == "__main__":
    sys.exit(main())
