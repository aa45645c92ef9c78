"""Import of DeepSpeed ZeRO checkpoints (checkpoint/deepspeed_import.py, ``elasticzero-checkpoint import-deepspeed``)
from files real DeepSpeed 0.19.8 wrote (``make_deepspeed_fixtures.py``): stages 1, 2 and 3 saved by 2 ranks load into
every elasticzero stage at 1, 2 or 3 ranks with fp32 masters and Adam moments bit-exact to what DeepSpeed reported,
and training continues as DeepSpeed's optimizer (``torch.optim.AdamW``) does from that state, run in the same process
(within the rounding that reference shows: ``ez_numerics``). Bad input is one line naming the file, nothing
unpickled freely, nothing written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_fork import drive

from elasticzero.checkpoint import cli, deepspeed_import
from elasticzero.errors import UsageError

HERE = Path(__file__).parent
FIXTURES = HERE / "data" / "deepspeed-0.19.8"


def test_imported_checkpoints_load_bit_exact_and_train_on_like_deepspeed(tmp_path: Path) -> None:
    out = tmp_path / "dsimport"
    drive(HERE / "deepspeed_import_worker.py", out, cases=8, timeout=300)


def _copy(stage: int, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / f"stage{stage}", tmp_path / f"stage{stage}"))


def _import(ds_dir: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["import-deepspeed", str(ds_dir), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("elasticzero-checkpoint: error: "), err
    assert not out.exists() or not any(out.iterdir()), "a failed import wrote something"
    return err


def test_missing_or_damaged_rank_files_are_one_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = _copy(2, tmp_path)
    (ds / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert "optimizer files of ranks [0], 2 ranks saved (missing [1])" in _import(ds, tmp_path / "a", capsys)
    ds3 = _copy(3, tmp_path)
    (ds3 / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    err = _import(ds3, tmp_path / "b", capsys)
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt: missing" in err, err
    optim = ds3 / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    err = _import(ds3, tmp_path / "c", capsys)
    assert f"{optim}: not a DeepSpeed checkpoint file this import reads (PytorchStreamReader failed" in err, err
    (ds3 / "latest").unlink()
    assert "latest: missing; pass --tag" in _import(ds3, tmp_path / "d", capsys)
    assert "no such DeepSpeed checkpoint directory" in _import(tmp_path / "nowhere", tmp_path / "e", capsys)
    (tmp_path / "empty" / "global_step1").mkdir(parents=True)
    (tmp_path / "empty" / "latest").write_text("global_step1\n")
    assert "no zero_pp_rank_*_optim_states.pt" in _import(tmp_path / "empty", tmp_path / "f", capsys)


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def test_hostile_pickle_is_refused_not_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = _copy(1, tmp_path)
    optim = ds / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "x": _Evil(str(tmp_path / "pwned"))}}, optim)
    err = _import(ds, tmp_path / "out", capsys)
    assert f"{optim}: not a DeepSpeed checkpoint file this import reads (refusing to import posix.system)" in err, err
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(UsageError, match=r"refusing to import posix\.system"):
        deepspeed_import.load_file(optim)


def test_an_existing_checkpoint_directory_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli.main(["import-deepspeed", "--tag", "global_step3", str(FIXTURES / "stage2"), str(out)]) == 0
    assert "(DeepSpeed 0.19.8, ZeRO-2, 2 ranks, float32) as step 3" in capsys.readouterr().out
    before = sorted(p.name for p in out.rglob("*"))
    assert cli.main(["import-deepspeed", str(FIXTURES / "stage3"), str(out)]) == 2
    assert "already holds checkpoints; import into a new directory" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before
    assert cli.main(["verify", str(out)]) == 0


def test_partitions_that_do_not_add_up_are_refused() -> None:
    shapes = {"a": [3, 2], "b": [5]}
    parts = [torch.arange(6.0), torch.arange(5.0)]
    assert [t.tolist() for t in deepspeed_import.unflatten_stage12(parts, shapes, "d").values()] == [
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        [0.0, 1.0, 2.0, 3.0, 4.0],
    ]
    with pytest.raises(UsageError, match="sizes do not add up"):
        deepspeed_import.unflatten_stage12([torch.zeros(4), torch.zeros(4)], shapes, "d")
    ranks = [torch.tensor([0.0, 1, 2, 6, 7, 8]), torch.tensor([3.0, 4, 5, 9, 10, 0])]  # 3 + 3 per rank, "b" padded
    three = deepspeed_import.unflatten_stage3(ranks, shapes, 2, "d")
    assert three["a"].tolist() == [0.0, 1, 2, 3, 4, 5] and three["b"].tolist() == [6.0, 7, 8, 9, 10]
    with pytest.raises(UsageError, match="the parameters need 6"):
        deepspeed_import.unflatten_stage3([torch.zeros(7), torch.zeros(7)], shapes, 2, "d")
