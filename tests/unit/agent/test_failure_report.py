"""Root-cause selection and the one-line failure report, on torch's own ProcessFailure objects."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticzero.agent.agent import describe_failure, root_cause


def failure_with_file(tmp_path: Path, rank: int, timestamp: int, message: str) -> ProcessFailure:
    path = tmp_path / f"rank{rank}.error.json"
    data = {"message": {"message": message, "extraInfo": {"py_callstack": "...", "timestamp": str(timestamp)}}}
    path.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def test_earliest_error_file_wins(tmp_path: Path) -> None:
    failures = {
        4: failure_with_file(tmp_path, 0, 200, "RuntimeError: collateral"),
        5: failure_with_file(tmp_path, 1, 100, "ValueError: the real one"),
    }
    rank, failure = root_cause(failures)
    assert rank == 5
    line = describe_failure(rank, failure)
    assert line.startswith("root cause: rank 5 (local rank 1, pid 101) exit code 1; error file: ")
    assert str(tmp_path / "rank1.error.json") in line and line.endswith("message: ValueError: the real one")


def test_signal_without_error_file() -> None:
    failure = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file="/nonexistent/error.json")
    line = describe_failure(3, failure)
    assert line == (
        "root cause: rank 3 (local rank 0, pid 7) signal SIGKILL; "
        "error file: none (the worker did not use torch's @record)"
    )


def test_collateral_sigterm_loses_a_tie() -> None:
    # torch SIGTERMs the other local workers when one fails and reports them too, in the same second
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file="/nonexistent/a.json"),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=7, error_file="/nonexistent/b.json"),
    }
    failures[0].timestamp = failures[1].timestamp
    assert root_cause(failures)[0] == 1
