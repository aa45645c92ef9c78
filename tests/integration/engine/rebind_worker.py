"""Worker for test_rebind: every call that rebinds or converts a managed parameter, and torch's own gradient clip, on
a ZeRO stage at world 2 (gloo). Each case wraps a fresh model, makes its call, records whether it was followed or
refused (the one line), then trains the model the plain loop's way (``zero_worker.train``: accumulation, the engine's
clip, StepLR) and compares it with single-process AdamW and the float64 truth (``ez_numerics``), so a followed call
and a refused one alike must leave a model that trains. Writes ``{s<stage>_<case>: {...}}`` for stages 1-3 as JSON
to ``<out>.rank<r>``.

Usage: ``python rebind_worker.py OUT`` under ``RANK``/``WORLD_SIZE``/``MASTER_*`` (``ez_testing.run_ranks``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elasticzero
from elasticzero.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (ez_numerics), for this worker run as a program
import zero_worker as zw

Call = Callable[[nn.Module, Any], None]


def _rebind_data(model: nn.Module, opt: Any) -> None:
    model.fc1.weight.data = torch.randn_like(model.fc1.weight)  # randn_like reads no storage (stage 3: freed)


def _new_parameter(model: nn.Module, opt: Any) -> None:
    model.fc2.weight = nn.Parameter(torch.randn(model.fc2.weight.shape))


def _first_micro_batch(model: nn.Module) -> None:
    rank, per = dist.get_rank(), zw.GLOBAL_BATCH // dist.get_world_size()
    x, y = zw.batch(0, 0)
    zw.loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()


def _rebind_before_step(model: nn.Module, opt: Any) -> None:
    """Forward and backward first, then ``param.data = ...``: the step is what finds it."""
    _first_micro_batch(model)
    _rebind_data(model, opt)
    try:
        opt.step()
    finally:
        opt.zero_grad()


def _torch_clip(model: nn.Module, opt: Any) -> None:
    """The habit of every loop: torch's clip over the module's parameters, after backward."""
    _first_micro_batch(model)
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        model.zero_grad()  # what the HF Trainer calls (set_to_none): takes the stand-ins down
        opt.zero_grad()


def _ddp_wrap(model: nn.Module, opt: Any) -> None:
    """What accelerate's ``prepare`` does at world > 1 (stage 3: a SIGSEGV reading the freed parameters)."""
    DistributedDataParallel(model)


def _forward(model: nn.Module) -> None:
    x, _ = zw.batch(0, 0)
    model(x[:1])


#: case -> (the call, whether it is followed (True) or refused (False))
CASES: dict[str, tuple[Call, bool]] = {
    "to_cpu0": (lambda m, o: m.to(torch.device("cpu", 0)), True),  # the HF Trainer's / accelerate's move: a copy
    "to_cpu": (lambda m, o: m.to("cpu"), True),
    "cpu": (lambda m, o: m.cpu(), True),
    "float": (lambda m, o: m.float(), True),
    "to_float32": (lambda m, o: m.to(torch.float32), True),
    "to_float64": (lambda m, o: m.to(torch.float64), False),
    "half": (lambda m, o: m.half(), False),
    "bfloat16_submodule": (lambda m, o: m.fc1.bfloat16(), False),
    "param_data": (lambda m, o: (_rebind_data(m, o), _forward(m)), False),
    "new_parameter": (lambda m, o: (_new_parameter(m, o), _forward(m)), False),
    "param_data_before_step": (_rebind_before_step, False),
    "torch_clip": (_torch_clip, False),
    "ddp_wrap": (_ddp_wrap, False),
}


def run_case(stage: int, call: Call) -> dict[str, Any]:
    """Wrap a fresh model, make ``call``, then train it; what happened and how the result compares."""
    model = zw.make_model()
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    opt = cls(model, torch.optim.AdamW, lr=zw.LR, weight_decay=zw.WD, bucket_bytes=zw.BUCKET_BYTES)
    refused = None
    try:
        call(model, opt)
    except (UsageError, RuntimeError) as exc:  # RuntimeError: DistributedDataParallel's own refusal
        refused = f"{type(exc).__name__}: {exc}"
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    zw.train(model, opt, zw.sched(opt), range(zw.STEPS))
    return {"refused": refused, "dtypes": dtypes, "ratio": zw.ratio(opt.full_state_dict())}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {f"s{stage}_{name}": run_case(stage, call) for stage in (1, 2, 3) for name, (call, _) in CASES.items()}
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
