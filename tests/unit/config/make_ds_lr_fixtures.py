"""Make ``data/deepspeed_lr_schedules.json``, the learning rates DeepSpeed's own schedule classes set, for
``test_lr_schedules.py``: real DeepSpeed, not a copy of its formulas.

Runs in a venv with DeepSpeed (``bash bench/_ds_venv.sh``: DeepSpeed 0.19.8, torch 2.13.0 CPU), one process:

    /work/ds-venv/bin/python tests/unit/config/make_ds_lr_fixtures.py

For each case (every schedule type, log and linear warmup, defaults and non-default parameters, per-group lists,
``last_batch_iteration`` resumes, an optimizer without betas) it builds the case's ``torch.optim`` optimizer, the
DeepSpeed class from ``deepspeed.runtime.lr_schedules`` with the case's params (as DeepSpeed's engine does:
``cls(optimizer, **params)``), and records each group's ``lr`` (and ``betas`` where the optimizer has them) in force
at each of ``steps`` optimizer steps, calling ``scheduler.step()`` after each, as DeepSpeed's engine does after every
optimizer step it takes. The values are plain Python float arithmetic (``math.log``/``math.cos`` from the C library
on doubles): the same on every CPU, written with ``repr`` precision (JSON round-trips them exactly).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "data" / "deepspeed_lr_schedules.json"

# (name, type, params, optimizer, lr, groups, steps)
CASES: list[tuple[str, str, dict[str, Any], str, float, int, int]] = [
    ("warmup_defaults", "WarmupLR", {}, "AdamW", 0.1, 1, 1004),
    ("warmup_log", "WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}, "AdamW", 0.1,
     1, 16),
    ("warmup_linear", "WarmupLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 8, "warmup_type": "linear"}, "SGD",
     0.1, 1, 12),
    ("warmup_one_step_log", "WarmupLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 1}, "AdamW", 0.1, 1, 5),
    ("warmup_one_step_linear", "WarmupLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 1, "warmup_type": "linear"},
     "AdamW", 0.1, 1, 5),
    ("warmup_group_lists", "WarmupLR", {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": [1e-3, 5e-3],
                                        "warmup_num_steps": 6}, "AdamW", 0.1, 2, 9),
    ("warmup_resume", "WarmupLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 10, "last_batch_iteration": 4},
     "AdamW", 0.1, 1, 10),
    ("decay_defaults", "WarmupDecayLR", {"total_num_steps": 1200}, "AdamW", 0.1, 1, 1205),
    ("decay_log", "WarmupDecayLR", {"total_num_steps": 30, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
                                    "warmup_num_steps": 10}, "AdamW", 0.1, 1, 35),
    ("decay_linear", "WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear"},
     "AdamW", 0.1, 1, 24),
    ("decay_total_below_warmup", "WarmupDecayLR", {"total_num_steps": 4, "warmup_num_steps": 6,
                                                   "warmup_type": "linear"}, "AdamW", 0.1, 1, 10),
    ("decay_resume", "WarmupDecayLR", {"total_num_steps": 30, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                                       "last_batch_iteration": 12}, "AdamW", 2e-4, 1, 22),
    ("cosine_defaults", "WarmupCosineLR", {"total_num_steps": 1100}, "AdamW", 2e-4, 1, 1104),
    ("cosine_log", "WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "cos_min_ratio": 0.1}, "AdamW",
     2e-4, 1, 30),
    ("cosine_linear", "WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 6, "warmup_min_ratio": 0.05,
                                         "warmup_type": "linear"}, "AdamW", 1e-3, 1, 28),
    ("cosine_total_below_warmup", "WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 6,
                                                     "warmup_type": "linear"}, "AdamW", 1e-3, 1, 10),
    ("cosine_two_groups", "WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3}, "AdamW", 1e-3, 2, 14),
    ("cosine_resume", "WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "last_batch_iteration": 7},
     "AdamW", 1e-3, 1, 20),
    ("onecycle_decay", "OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4,
                                    "cycle_second_step_size": 6, "decay_step_size": 3, "decay_lr_rate": 0.5,
                                    "decay_mom_rate": 0.05}, "AdamW", 0.1, 1, 24),
    ("onecycle_defaults", "OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2}, "AdamW", 0.1, 1, 4010),
    ("onecycle_no_betas", "OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                                       "cycle_momentum": True}, "SGD", 0.5, 1, 10),
    ("onecycle_no_momentum", "OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                                          "cycle_momentum": False, "decay_step_size": 2, "decay_lr_rate": 0.1},
     "AdamW", 0.5, 1, 16),
    ("onecycle_stairs", "OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6,
                                     "cycle_second_step_size": 9, "cycle_first_stair_count": 3,
                                     "cycle_second_stair_count": 2}, "AdamW", 0.1, 1, 34),
    ("onecycle_stairs_default_second", "OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                    "cycle_first_step_size": 4, "cycle_first_stair_count": 2},
     "AdamW", 0.1, 1, 20),
    ("onecycle_zero_second_half", "OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4,
                                               "cycle_second_step_size": 0, "decay_step_size": 1,
                                               "decay_lr_rate": 0.3}, "AdamW", 0.1, 1, 12),
    ("onecycle_group_lists", "OneCycle", {"cycle_min_lr": [1e-3, 2e-3], "cycle_max_lr": [1e-2, 3e-2],
                                          "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": [0.9, 0.95],
                                          "cycle_first_step_size": 3}, "AdamW", 0.1, 2, 9),
    ("onecycle_resume", "OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4,
                                     "last_batch_iteration": 5, "decay_step_size": 2, "decay_lr_rate": 0.2},
     "AdamW", 0.1, 1, 12),
    ("range_defaults", "LRRangeTest", {}, "AdamW", 0.1, 1, 6),
    ("range_continuous", "LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5,
                                         "lr_range_test_step_rate": 0.5}, "AdamW", 0.1, 1, 16),
    ("range_staircase", "LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5,
                                        "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}, "SGD", 0.1,
     1, 16),
    ("range_resume", "LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3,
                                     "last_batch_iteration": 3}, "AdamW", 0.1, 1, 8),
]  # fmt: skip


def run(case: tuple[str, str, dict[str, Any], str, float, int, int]) -> dict[str, Any]:
    import torch
    from deepspeed.runtime import lr_schedules

    name, kind, params, optimizer, lr, groups, steps = case
    opt = getattr(torch.optim, optimizer)([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)],
                                          lr=lr)  # fmt: skip
    sched = getattr(lr_schedules, kind)(opt, **params)
    lrs, betas = [], []
    for _ in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        betas.append([list(g["betas"]) for g in opt.param_groups] if "betas" in opt.defaults else None)
        opt.step()
        sched.step()
    return {"name": name, "type": kind, "params": params, "optimizer": optimizer, "lr": lr, "groups": groups,
            "lrs": lrs, "betas": betas}  # fmt: skip


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    cases = [run(c) for c in CASES]
    doc = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "cases": cases}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases)", file=sys.stderr)


if __name__ == "__main__":
    main()
