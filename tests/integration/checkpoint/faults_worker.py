"""Driver for test_ckpt_faults: ``faults_worker.py OUT PHASE:RANK...`` forks the ranks of every scenario
(:mod:`ckpt_fork`) and writes ``OUT.summary``.

Faults (world 2): an async save whose tensors are mutated right after ``save`` returns (the checkpoint holds the
values of the snapshot), then loads of damaged copies of a good checkpoint (another model, truncated file, flipped
byte, a rank's shard missing, unknown format, a .metadata that tries to import ``os.system``): each must raise one
``UsageError`` on every rank and leave the optimizer untouched. Writes ``{case: result}`` to ``OUT.rank<r>``.

Kills (world 2, per PHASE:RANK): commits step 2, then saves step 4 with ``keep_last=1`` and SIGKILLs itself on
rank ``RANK`` at ``PHASE`` of the commit protocol; rank 0 first stores the full state of both steps in
``<scenario>.ref<step>.pt``.

Load (world 1): loads the newest checkpoint of every ``DIR`` and compares it bitwise with the
``ref<step>.pt`` stored beside it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_fork import fork_world, join, stop, wait_killed
from ckpt_model import build, full_state, mismatches, train
from torch import nn

from elasticzero.checkpoint import Checkpointer, digest
from elasticzero.checkpoint import commit as commit_mod
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState
from elasticzero.errors import UsageError


def state_of(opt: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zero": ZeroCheckpointState(opt), "extra": extra if extra is not None else {"seen": 0}}


def torn(root: Path) -> list[str]:
    opt = build(2, "fp32", None, seed=1)
    train(opt, range(2))
    before = full_state(opt)
    ckpt = Checkpointer(root / "torn", async_save=True)
    ckpt.save(2, state_of(opt))
    with torch.no_grad():  # mutate everything the snapshot copied, before the background write can have finished
        for m in opt.masters:
            m.add_(1000.0)
        for st in opt.optim.state.values():
            st["exp_avg"].add_(1000.0)
            st["step"].add_(7)
    train(opt, range(2, 3))
    ckpt.wait()
    fresh = build(2, "fp32", None, seed=5)
    ckpt.load_latest(state_of(fresh))
    ckpt.close()
    return [f"torn: {k}" for k in mismatches(fresh, before)]


def damage(case: str, d: Path) -> None:
    """Damage the copy ``d`` of a good checkpoint step directory (rank 0 only)."""
    data = sorted(p for p in d.iterdir() if p.suffix == ".distcp")
    if case == "truncated":
        with open(data[-1], "r+b") as f:
            f.truncate(data[-1].stat().st_size // 2)
    elif case == "flipped":
        with open(data[0], "r+b") as f:
            f.seek(data[0].stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
    elif case == "shard_missing":
        data[-1].unlink()
    elif case in ("format", "evil_metadata"):
        manifest = json.loads((d / commit_mod.MANIFEST).read_text())
        if case == "format":
            manifest["format"] = 99
        else:
            (d / ".metadata").write_bytes(pickle.dumps(_Evil(str(d.parent.parent / "pwned"))))
            manifest["files"][".metadata"] = {
                "size": (d / ".metadata").stat().st_size,
                "xxh3_64": digest.of_file(d / ".metadata"),
            }
        (d / commit_mod.MANIFEST).write_text(json.dumps(manifest))


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


class _Other(nn.Module):  # another model: same parameter names, other shapes
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)


def bad_loads(root: Path) -> dict[str, str]:
    rank = dist.get_rank()
    opt = build(3, "bf16", None, seed=1)
    train(opt, range(2))
    good = root / "good"
    ckpt = Checkpointer(good)
    ckpt.save(2, state_of(opt, {"seen": 12}))
    full = opt.full_state_dict()
    if rank == 0:
        torch.save(full, root / "good_full.pt")
    results = {}
    for case in ("truncated", "flipped", "shard_missing", "format", "evil_metadata", "other_model"):
        d = root / case
        if rank == 0:
            shutil.copytree(good, d)
            damage(case, d / commit_mod.step_dir(2))
        dist.barrier()
        victim = build(3, "bf16", None, seed=3)
        if case == "other_model":
            victim = build_other()
        train(victim, range(1)) if case != "other_model" else None
        before = full_state(victim)
        extra = {"seen": 5}
        try:
            Checkpointer(d, read_only=True).load_latest(state_of(victim, extra))
            results[case] = "loaded"
        except UsageError as exc:
            results[case] = f"UsageError: {exc}"
        changed = mismatches(victim, before)
        if changed or extra != {"seen": 5}:
            results[case] += f" | CHANGED {changed[:3]} {extra}"
    results["pwned"] = str((root / "pwned").exists())
    return results


def build_other() -> Any:
    from elasticzero.engine.zero.stage3 import ZeroStage3

    torch.manual_seed(0)
    return ZeroStage3(_Other(), torch.optim.AdamW, lr=0.05)


def kill(out: str, phase: str, victim: int) -> dict[str, Any]:
    rank = dist.get_rank()
    root = Path(out + ".d")

    def hook(p: str, step: int) -> None:
        if (p, step, rank) == (phase, 4, victim):
            os.kill(os.getpid(), signal.SIGKILL)

    opt = build(2, "fp32", None, seed=1)
    ckpt = Checkpointer(root, keep_last=1, phase_hook=hook)
    for step in (2, 4):
        train(opt, range(step - 2, step))
        ref = full_state(opt)
        if rank == 0:
            torch.save(ref, f"{out}.ref{step}.pt")
        dist.barrier()
        ckpt.save(step, state_of(opt))
    return {"finished": True}


def load(dirs: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for d in dirs:
        opt = build(3, "fp32", None, seed=9)
        step = Checkpointer(Path(d + ".d"), read_only=True).load_latest(state_of(opt))
        ref = torch.load(f"{d}.ref{step}.pt", weights_only=True)
        results[d] = {"step": step, "mismatches": mismatches(opt, ref)}
    return results


def faults(root: Path) -> dict[str, Any]:
    return {"torn": torn(root), **bad_loads(root)}


def main(out: str, kills: list[tuple[str, int]]) -> None:
    """Faults at world 2; then each (phase, victim) kill scenario at world 2 (the victim must die of SIGKILL, the
    survivor is stopped); then one world-1 load of every scenario's directory."""
    base = Path(out)
    summary: dict[str, Any] = {"faults": join(fork_world(2, faults, base, Path(out + ".d")), base)}
    runs = []
    for phase, victim in kills:
        kout = Path(f"{out}.kill_{phase}")
        pids = fork_world(2, kill, kout, str(kout), phase, victim)
        summary[f"killed_{phase}"] = wait_killed(pids[victim])
        stop(pids[1 - victim])
        runs.append(str(kout))
    summary["load"] = join(fork_world(1, load, Path(f"{out}.load"), runs), Path(f"{out}.load"))[0]
    Path(f"{out}.summary").write_text(json.dumps(summary))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], [(p, int(v)) for p, v in (a.split(":") for a in sys.argv[2:])])
