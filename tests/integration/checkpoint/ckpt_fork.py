"""Run gloo "ranks" as forked children of one driver process, so torch is imported once for many short worlds
(each a fresh process group on its own port). The driver must not initialise torch.distributed or start threads
before forking."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the driver scripts run as programs
from ez_testing import free_port


def fork_world(world: int, fn: Callable[..., Any], out: Path, *args: Any) -> list[int]:
    """Fork ``world`` children; child ``r`` joins a fresh gloo group, runs ``fn(*args)`` and writes its JSON
    result to ``out.rank<r>`` (or its traceback to ``out.err<r>``, exit 1). Returns the children's pids."""
    port = str(free_port())
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:  # child
            os._exit(_child(r, world, port, fn, out, args))
        pids.append(pid)
    return pids


def _child(rank: int, world: int, port: str, fn: Callable[..., Any], out: Path, args: Any) -> int:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo")
        result = fn(*args)
        Path(f"{out}.rank{rank}").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException:
        Path(f"{out}.err{rank}").write_text(traceback.format_exc())
        return 1


def join(pids: list[int], out: Path) -> list[Any]:
    """Wait for every child; raise with the first traceback if one failed; return their results."""
    for r, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            err = Path(f"{out}.err{r}")
            raise RuntimeError(f"rank {r} failed: {err.read_text() if err.exists() else status}")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(len(pids))]


def wait_killed(pid: int) -> bool:
    """Wait for ``pid`` to exit; True if it died of SIGKILL."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == -signal.SIGKILL


def stop(pid: int) -> None:
    """SIGKILL our child ``pid`` if it is still running (stuck in a collective with a dead rank) and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def run_cases(out: str, cases: list[tuple[Any, ...]], run_case: Callable[..., list[str]]) -> dict[str, list[str]]:
    """In a forked rank of a world of 3: ``run_case(case, groups, OUT.d)`` for every case, with a process group over
    ranks [0, k) for k in 1..3; ``{case name: problems}``."""
    import torch.distributed as dist

    groups = {k: dist.new_group(list(range(k))) for k in (1, 2, 3)}
    return {"_".join(map(str, c)): run_case(c, groups, Path(out + ".d")) for c in cases}


def drive(script: Path, out: Path, cases: int, timeout: float) -> None:
    """Run a driver ``script OUT`` in a fresh interpreter (this directory importable); it must exit 0 and each of its 3
    ranks must report ``cases`` cases, none with a problem."""
    path = os.pathsep.join([str(script.parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    argv = [sys.executable, str(script), str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    for r in range(3):
        res = json.loads(Path(f"{out}.rank{r}").read_text())
        assert len(res) == cases, f"rank {r}: {len(res)} cases"
        failed = {case: problems for case, problems in res.items() if problems}
        assert not failed, f"rank {r}: {failed}"
