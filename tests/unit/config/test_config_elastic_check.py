"""``check_elastic_config`` / ``load_elastic_batch``: the launchers' start-up check of an elastic config (pure, no
torch on the path) — which world sizes ``--nnodes MIN:MAX`` x ``--nproc-per-node`` allow, and one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticzero.config import check_elastic_config, load_config, load_elastic_batch
from elasticzero.errors import UsageError

REPO = Path(__file__).resolve().parents[3]
ELASTIC_YAML = "elasticity: {enabled: true, max_train_batch_size: 24, micro_batch_sizes: [2, 4], max_world_size: 12}\n"


def _write(tmp_path: Path, name: str, body: str | dict) -> Path:
    path = tmp_path / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


@pytest.mark.parametrize(
    ("name", "body", "valid"),
    [
        ("elastic.yaml", ELASTIC_YAML, [1, 2, 3, 4, 6, 12]),
        ("fixed.yaml", "train_batch_size: 16\nmicro_batch_size: 4\n", [1, 2, 4]),
        ("ds_micro.json", {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, [1, 2, 4]),
        ("ds_accum.json", {"train_batch_size": 12, "gradient_accumulation_steps": 2}, [1, 2, 3, 6]),
        ("ds_train.json", {"train_batch_size": 6, "zero_optimization": {"stage": 2}}, [1, 2, 3, 6]),
        (
            "ds_elastic.json",
            {
                "zero_optimization": {"stage": 3},
                "elasticity": {
                    "enabled": True,
                    "max_train_batch_size": 24,
                    "micro_batch_sizes": [2, 4],
                    "max_gpus": 12,
                },
            },
            [1, 2, 3, 4, 6, 12],
        ),
    ],
)
def test_valid_world_sizes_match_what_the_job_accepts(tmp_path: Path, name: str, body: str | dict, valid: list[int]):
    path = _write(tmp_path, name, body)
    batch = load_elastic_batch(path)
    assert batch is not None and batch.valid_world_sizes() == valid
    for world in range(1, 14):  # the job's own check at start agrees at every world size
        try:
            load_config(path, world_size=world)
            accepted = True
        except UsageError:
            accepted = False
        assert accepted == (world in valid), (name, world)


def test_a_world_size_without_a_plan_is_one_line_naming_sizes_and_fix(tmp_path: Path) -> None:
    path = _write(tmp_path, "train.yaml", "train_batch_size: 16\nmicro_batch_size: 4\n")
    assert check_elastic_config(path, 1, 2, 2) is not None  # worlds 2, 4
    with pytest.raises(UsageError) as err:
        check_elastic_config(path, 1, 3, 2)  # worlds 2, 4, 6
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: --nnodes 1:3 x --nproc-per-node 2 allows world size(s) 6 ")
    assert "global batch 16 (valid world sizes: 1-2, 4); narrow --nnodes or change the batch sizes" in msg


def test_global_batch_following_the_world_passes_every_range(tmp_path: Path) -> None:
    path = _write(tmp_path, "free.yaml", "micro_batch_size: 4\naccumulation_steps: 2\n")
    assert check_elastic_config(path, 1, 7, 3) is None


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("zero: {stag: 2}\n", "unknown key 'zero.stag'"),
        ("micro_batch_size: many\n", "micro_batch_size"),
        ("elasticity: {enabled: true, micro_batch_sizes: [2]}\n", "elasticity.max_train_batch_size must be >= 1"),
    ],
)
def test_bad_config_is_a_usage_error_naming_the_file(tmp_path: Path, body: str, fragment: str) -> None:
    path = _write(tmp_path, "bad.yaml", body)
    with pytest.raises(UsageError, match=fragment) as err:
        check_elastic_config(path, 1, 2, 1)
    assert str(err.value).startswith(str(path))


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read config"):
        check_elastic_config(tmp_path / "nope.yaml", 1, 2, 1)


def test_the_check_does_not_import_torch(tmp_path: Path) -> None:
    """Launch overhead: the front-end's check reads the file with omegaconf only."""
    path = _write(tmp_path, "elastic.yaml", ELASTIC_YAML)
    code = f"import sys; from elasticzero.config import check_elastic_config as c; c({str(path)!r}, 1, 4, 1); "
    code += "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
