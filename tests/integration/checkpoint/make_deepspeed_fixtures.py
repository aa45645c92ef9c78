"""Make the DeepSpeed checkpoints ``test_ckpt_deepspeed_import.py`` imports: real DeepSpeed, not hand-built files.

Runs in DeepSpeed's venv (``bash bench/_ds_venv.sh``: DeepSpeed 0.19.8, torch 2.13.0 CPU), two gloo ranks on CPU:

    /work/ds-venv/bin/python tests/integration/checkpoint/make_deepspeed_fixtures.py

For each ZeRO stage 1, 2, 3 in fp32 (and 2, 3 in bf16) it trains ``tiny_net.Net`` (``torch.optim.AdamW``, no
clipping) 3 steps on the same global batches the elasticzero tests use, ``save_checkpoint``\\ s into
``data/deepspeed-<version>/stage<s>[-bf16]/``, records what DeepSpeed itself says the full state is
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``): ``expected.pt`` (plain tensors, ``weights_only``).
Nothing DeepSpeed computes after the save is recorded: the test checks the training that follows the import against
plain torch run from this state on the test's own machine (a trajectory recorded here would hold this CPU's rounding).
Only the tag directory, ``latest`` and ``expected.pt`` are kept (not the converter script DeepSpeed copies in).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAG = "global_step3"
CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")]  # (ZeRO stage, precision)


def rank_main(stage: int, precision: str, out: Path) -> None:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from tiny_net import GLOBAL_BATCH, LR, WD, Net, batch, loss_of

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    per = GLOBAL_BATCH // world
    config = {
        "train_micro_batch_size_per_gpu": per,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "bf16": {"enabled": precision == "bf16"},
    }
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def train(steps: range) -> None:
        for step in steps:
            x, y = batch(step)
            eng.backward(loss_of(eng, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
            eng.step()

    def full(key: str | None) -> dict[str, torch.Tensor]:
        get = safe_get_full_fp32_param if key is None else lambda p: safe_get_full_optimizer_state(p, key)
        return {n: get(p).detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    train(range(3))
    eng.save_checkpoint(str(out), tag=TAG)
    expected = {"fp32": full(None), "exp_avg": full("exp_avg"), "exp_avg_sq": full("exp_avg_sq")}
    expected["step"] = torch.tensor(3)
    if rank == 0:
        torch.save(expected, out / "expected.pt")


def main() -> None:
    import deepspeed

    root = HERE / "data" / f"deepspeed-{deepspeed.__version__}"
    for stage, precision in CASES:
        out = root / f"stage{stage}{'' if precision == 'fp32' else '-' + precision}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
        argv = [sys.executable, __file__, "--rank", str(stage), precision, str(out)]
        procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
        if any(p.wait(timeout=900) != 0 for p in procs):
            raise SystemExit(f"stage {stage}: a rank failed")
        for copied in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its converter in
            (out / copied).unlink(missing_ok=True)
        print(f"stage {stage}: {sorted(str(p.relative_to(out)) for p in out.rglob('*') if p.is_file())}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        main()
