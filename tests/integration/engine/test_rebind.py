"""Item 0 of the front doors: anything that rebinds or converts a parameter a ZeRO stage manages is followed or
refused, never trained silently wrong, never a SIGSEGV; torch's own ``clip_grad_norm_`` over the module's parameters
fails loudly instead of returning 0.0 and clipping nothing. Stages 1-3 at world 2 on gloo (``rebind_worker``).

After each call, followed or refused, the model trains: its parameters after ``zero_worker.STEPS`` steps of the plain
loop are within fp32 rounding of single-process AdamW on the same global batches (``ez_numerics.error_ratio`` <= 1:
the reference's own distance to the float64 truth, times 3). A followed conversion keeps every parameter's dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rebind_worker import CASES

from ez_testing import run_ranks

WORKER = Path(__file__).with_name("rebind_worker.py")
STAGES = [1, 2, 3]
RATIO_MAX = 1.0  # ez_numerics: rmse(ZeRO, fp64 truth) <= 3 * rmse(fp32 reference, fp64 truth) + 2^-24 * rms(truth)

#: what the one line of each refused call names: the call (or the op torch's clip reached) and the fix
REFUSALS = {
    "to_float64": (
        "Tiny.to() would convert the parameters ZeroStage{stage} manages from torch.float32 to torch.float64",
        "precision='bf16' or 'fp16'",
    ),
    "half": ("Tiny.half() would convert", "convert the model before wrapping"),
    "bfloat16_submodule": ("Linear.bfloat16() would convert", "precision='bf16'"),
    "param_data": ("Tiny.forward found fc1.weight rebound", "opt.load_full_state_dict"),
    "new_parameter": ("Tiny.forward found fc2.weight rebound", "opt.load_full_state_dict"),
    "param_data_before_step": ("opt.step() found fc1.weight rebound", "opt.load_full_state_dict"),
    "torch_clip": ("aten.linalg_vector_norm", "opt.clip_grad_norm_(max_norm)"),
    # DDP's own line, raised before it reads a parameter: the engine left it none to reduce (no SIGSEGV on stage 3)
    "ddp_wrap": ("RuntimeError: DistributedDataParallel is not needed", ""),
}

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(WORKER, 2, tmp_path_factory.mktemp("rebind") / "out", timeout=540)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_call_is_followed_or_refused_and_the_model_trains(
    ranks: list[dict[str, Any]], stage: int, case: str
) -> None:
    followed = CASES[case][1]
    for rank in ranks:
        got = rank[f"s{stage}_{case}"]
        if followed:
            assert got["refused"] is None, got["refused"]
            assert got["dtypes"] == ["torch.float32"]
        else:
            call, fix = (s.format(stage=stage) for s in REFUSALS[case])
            message = got["refused"] or ""
            assert call in message and fix in message and "\n" not in message, message
            assert message.startswith(f"UsageError: ZeroStage{stage}: ") or case == "ddp_wrap"
        assert got["ratio"] <= RATIO_MAX
