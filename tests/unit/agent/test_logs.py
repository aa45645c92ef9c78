"""ElasticZeroLogsSpecs: destinations named by global rank and attempt, straight from torch's worker env."""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import Std

from elasticzero.agent.logs import ElasticZeroLogsSpecs


def envs(ranks: list[int], attempt: int = 0, group_rank: int = 1) -> dict[int, dict[str, str]]:
    return {
        lr: {
            "RANK": str(r),
            "TORCHELASTIC_RUN_ID": "job9",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "GROUP_RANK": str(group_rank),
        }
        for lr, r in enumerate(ranks)
    }


def test_files_named_by_global_rank_and_attempt(tmp_path: Path) -> None:
    spec = ElasticZeroLogsSpecs(str(tmp_path), Std.ALL, Std.NONE, None)
    e = envs([2, 3], attempt=1)
    dest = spec.reify(e)
    run = tmp_path / "job9"
    assert dest.stdouts == {0: str(run / "rank2.attempt1.stdout.log"), 1: str(run / "rank3.attempt1.stdout.log")}
    assert dest.stderrs[1] == str(run / "rank3.attempt1.stderr.log")
    assert dest.error_files[0] == str(run / "rank2.attempt1.error.json")
    assert e[0]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[0]  # workers' @record writes there
    assert dest.tee_stdouts == {}
    assert dest.filtered_stdout == str(run / "node1.attempt1.filtered_stdout.log")


def test_never_clobbers_an_existing_attempt(tmp_path: Path) -> None:
    spec = ElasticZeroLogsSpecs(str(tmp_path), Std.ALL, Std.NONE, None)
    first = spec.reify(envs([0]))
    Path(first.stdouts[0]).write_text("first run")
    second = spec.reify(envs([0]))  # a membership restart keeps TORCHELASTIC_RESTART_COUNT
    assert second.stdouts[0].endswith("rank0.attempt0.1.stdout.log")
    assert Path(first.stdouts[0]).read_text() == "first run"


def test_tee_console_and_local_ranks_filter(tmp_path: Path) -> None:
    spec = ElasticZeroLogsSpecs(str(tmp_path), Std.NONE, Std.OUT, {0})
    dest = spec.reify(envs([4, 5]))
    assert dest.tee_stdouts == {0: dest.stdouts[0]}  # rank 1 is filtered from the console but still logged
    assert dest.stdouts[1].endswith("rank5.attempt0.stdout.log")
    assert dest.stderrs == {0: "", 1: os.devnull}  # unredirected stderr: console for 0, hidden for filtered 1


def test_devnull(tmp_path: Path) -> None:
    dest = ElasticZeroLogsSpecs(os.devnull, Std.ALL, Std.NONE, None).reify(envs([0]))
    assert dest.error_files == {0: os.devnull}
