"""Driver for test_ckpt_deepspeed_import: imports each DeepSpeed fixture (stages 1/2/3, saved by 2 DeepSpeed ranks)
with the ``elasticzero-checkpoint import-deepspeed`` command, then forks a world of 3 ranks (ckpt_fork.py). For every
case (DeepSpeed stage -> elasticzero stage, M ranks) ranks [0, M) build a fresh ZeRO optimizer, load the imported
checkpoint and compare fp32 masters, Adam moments and step bitwise with what DeepSpeed itself reported (a loaded state
is the saved one on any machine). Then they train the two steps DeepSpeed trained after its save and compare with
plain torch run in this process from DeepSpeed's reported state (``torch.optim.AdamW``, the optimizer DeepSpeed
stepped): the continuation is checked here, not against a trajectory recorded on another CPU, whose kernels round
differently. Each rank writes ``{case: [problems]}`` to ``OUT.rank<r>``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_fork import fork_world, join, run_cases
from ckpt_model import PlainState, build, continue_plainly, full_state, train

from elasticzero.checkpoint import Checkpointer
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from ez_numerics import error_ratio

FIXTURES = Path(__file__).resolve().parent / "data" / "deepspeed-0.19.8"
FIXTURE_NAMES = ("stage1", "stage2", "stage3", "stage2-bf16", "stage3-bf16")
CASES = [  # (fixture, precision, elasticzero stage, M ranks)
    *[("stage1", "fp32", 1, 2), ("stage2", "fp32", 2, 2), ("stage3", "fp32", 3, 2)],
    *[("stage2", "fp32", 3, 1), ("stage3", "fp32", 1, 3), ("stage1", "fp32", 2, 3)],
    *[("stage2-bf16", "bf16", 2, 2), ("stage3-bf16", "bf16", 1, 3)],
]


def import_all(root: Path) -> None:
    for name in FIXTURE_NAMES:
        code = "import sys; from elasticzero.checkpoint.cli import main; sys.exit(main(sys.argv[1:]))"
        argv = ["import-deepspeed", str(FIXTURES / name), str(root / name)]
        subprocess.run([sys.executable, "-c", code, *argv], check=True, capture_output=True, timeout=120)


def run_case(case: tuple[str, str, int, int], groups: dict[int, Any], root: Path) -> list[str]:
    fixture, precision, stage, m = case
    if dist.get_rank() >= m:
        return []
    expected = torch.load(FIXTURES / fixture / "expected.pt", weights_only=True)
    opt = build(stage, precision, groups[m], seed=2)
    step = Checkpointer(root / fixture, process_group=groups[m], read_only=True).load_latest(
        {"zero": ZeroCheckpointState(opt)}
    )
    problems = [] if step == 3 else [f"loaded step {step}, 3 expected"]
    got = full_state(opt)
    for name, master in expected["fp32"].items():
        for key, want in ((name, master), *((f"{name}.{k}", expected[k][name]) for k in ("exp_avg", "exp_avg_sq"))):
            if not torch.equal(got[key], want.reshape(-1)):
                problems.append(f"not bit-exact after import: {key}")
        if got[f"{name}.step"].item() != expected["step"].item():
            problems.append(f"{name}: step {got[f'{name}.step'].item()}")
    module = opt.full_state_dict()
    frozen = module["frozen.weight"]  # in the model's dtype (bf16 with bf16) in DeepSpeed's checkpoint and here
    if not torch.equal(frozen, saved_frozen(fixture)) or module["calls"].item() != 3:
        problems.append("frozen parameter or buffer not DeepSpeed's")
    train(opt, range(3, 5))
    after = opt.full_state_dict()
    return problems + continuation_problems(after, fixture, expected, m, precision)


def saved_frozen(fixture: str) -> torch.Tensor:
    """The frozen weight in DeepSpeed's own files, read with plain ``torch.load``: whole in stages 1/2, one fragment
    per rank in stage 3 (the module entry is empty there)."""
    files = sorted((FIXTURES / fixture / "global_step3").glob("*model_states.pt"))
    models = [torch.load(f, weights_only=True) for f in files]
    whole = models[0]["module"]["frozen.weight"]
    if whole.numel():
        return whole
    flat = torch.cat([m["frozen_param_fragments"]["frozen.weight"].reshape(-1) for m in models])
    shape = models[0]["frozen_param_shapes"]["frozen.weight"]
    return flat[: shape.numel()].reshape(shape)


def continuation_problems(
    after: dict[str, torch.Tensor], fixture: str, expected: dict[str, Any], m: int, prec: str
) -> list[str]:
    """The two steps after the import against plain torch run here from DeepSpeed's state: the same arithmetic in
    ``prec`` (the reference) and in float64 (the truth); the ZeRO run may be off the truth by what rounding moved
    the reference (ez_numerics)."""
    start = PlainState(expected["fp32"], expected["exp_avg"], expected["exp_avg_sq"], expected["step"].item())
    frozen = saved_frozen(fixture)
    ref, truth = (continue_plainly(start, frozen, 3, range(3, 5), m, p) for p in (prec, "fp64"))
    ratio = error_ratio({k: after[k] for k in truth}, ref, truth)
    return [] if ratio <= 1 else [f"{prec} state after 2 more steps off by {ratio:.3g}x the {prec} rounding scale"]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = sys.argv[1]
    import_all(Path(out + ".d"))
    join(fork_world(3, run_cases, Path(out), out, CASES, run_case), Path(out))
