"""The DeepSpeed configs users actually have (``examples/configs/``: the Hugging Face docs' ``ds_config_zero2.json``
and ``ds_config_zero3.json`` verbatim, and a user's config with ``WarmupDecayLR`` + ``offload_optimizer`` +
``activation_checkpointing``) load with ``strict=True`` once their ``"auto"`` values are filled (``fill_auto``, the
Hugging Face Trainer's rule, from the example job's own arguments), and train the example job
(``examples/train_gpt.py``, a world of one on the CPU) a few steps. On the CPU offload is the identity and
``cpu_checkpointing`` keeps the saved inputs where they are (both decided, not skipped: docs/engine.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import elasticzero.config
from elasticzero.config import load_config, read_file
from elasticzero.config.schema import ZeroConfig
from ez_testing import REPO

CONFIGS = REPO / "examples" / "configs"
EXAMPLE = REPO / "examples" / "train_gpt.py"
STEPS, MICRO, ACCUM, LR = 3, 4, 4, 2e-3  # the user's config states these (16 = 4 x 4 x world 1)
USER = "ds_user_offload.json"

# the scheduler, "auto" filling and offload keys these configs use (the items 1-3)
HAVE_FEATURES = hasattr(elasticzero.config, "fill_auto") and "offload" in {
    f.name for f in dataclasses.fields(ZeroConfig)
}
pytestmark = [
    pytest.mark.skipif(not HAVE_FEATURES, reason="needs the scheduler section, fill_auto and zero.offload"),
    pytest.mark.timeout(600),
]


def _auto() -> object:
    """The example job's arguments, as the Hugging Face Trainer would hand them to fill ``"auto"`` (fp32 on the CPU)."""
    from elasticzero.config import AutoValues  # type: ignore[attr-defined]

    return AutoValues(
        world_size=1, micro_batch_size=MICRO, accumulation_steps=ACCUM, lr=LR, betas=(0.9, 0.95), eps=1e-8,
        weight_decay=0.1, clip_grad_norm=1.0, fp16=False, bf16=False, warmup_steps=2, total_steps=STEPS,
        hidden_size=256,
    )  # fmt: skip


def _filled(name: str) -> dict[str, object]:
    """The config as the job loads it: its ``"auto"`` values filled (the user's config has none: it is its own)."""
    from elasticzero.config import fill_auto  # type: ignore[attr-defined]

    data = read_file(CONFIGS / name)
    return data if name == USER else fill_auto(data, _auto(), source=name)


@pytest.mark.parametrize(
    ("name", "stage", "scheduler", "offload", "checkpointing"),
    [
        ("ds_zero2_hf.json", 2, "WarmupLR", True, False),
        ("ds_zero3_hf.json", 3, "WarmupLR", True, False),
        ("ds_user_offload.json", 2, "WarmupDecayLR", True, True),
    ],
)
def test_loads_strictly_once_auto_is_filled(
    name: str, stage: int, scheduler: str, offload: bool, checkpointing: bool
) -> None:
    cfg = load_config(_filled(name), world_size=1, strict=True)
    assert cfg.zero.stage == stage and cfg.scheduler.type == scheduler  # type: ignore[attr-defined]
    assert cfg.zero.offload.optimizer is offload  # type: ignore[attr-defined]
    assert cfg.activation_checkpointing.enabled is checkpointing
    assert (cfg.micro_batch_size, cfg.accumulation_steps) == (MICRO, ACCUM)
    assert cfg.optimizer.params["lr"] == LR and cfg.clip_grad_norm == 1.0


@pytest.mark.parametrize("name", ["ds_zero2_hf.json", "ds_zero3_hf.json", "ds_user_offload.json"])
def test_the_example_job_trains_with_it(name: str, tmp_path: Path) -> None:
    config = tmp_path / name
    config.write_text(json.dumps(_filled(name)))
    argv = [sys.executable, str(EXAMPLE), "--config", str(config), "--steps", str(STEPS), "--size", "tiny"]
    argv += ["--seq-len", "32", "--corpus-bytes", "65536", "--cache-dir", str(tmp_path / "corpus")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [float(m) for m in re.findall(r"step +\d+/\d+ +loss (\S+)", done.stdout)]
    assert f"step     {STEPS}/{STEPS}" in done.stdout and losses, done.stdout
    assert all(0 < loss < 10 for loss in losses), done.stdout  # finite, around ln(256) = 5.5 at the start
