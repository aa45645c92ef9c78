"""Gloo ranks forked from a bench's driver (torch imported once): each runs ``work(rank, args)`` in a process group on
127.0.0.1 and leaves its JSON result beside ``out``; the driver reads them back in rank order."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ez_ports import free_port

Work = Callable[[int, argparse.Namespace], dict[str, Any]]


def result_path(given: Path | None, name: str) -> Path:
    """``given``, else ``bench/results/<name>-<utc>.json``; its folder made."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = given or Path(__file__).resolve().parent / "results" / f"{name}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _child(rank: int, world: int, port: str, work: Work, args: argparse.Namespace, out: Path) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    Path(f"{out}.rank{rank}").write_text(json.dumps(work(rank, args)))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_forked(world: int, work: Work, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Fork ``world`` ranks running ``work``; their results, in rank order (SystemExit if a rank failed)."""
    port, pids = str(free_port()), []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            os._exit(_child(r, world, port, work, args, out))
        pids.append(pid)
    for pid in pids:
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            raise SystemExit("a rank failed")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def save(out: Path, args: argparse.Namespace, summary: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """The run's arguments, summary and per-rank results as JSON at ``out``."""
    res = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "ranks": ranks}
    out.write_text(json.dumps(res, indent=1))
