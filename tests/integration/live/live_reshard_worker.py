"""Driver for test_live_reshard: ``live_reshard_worker.py OUT`` forks a world of 3 gloo ranks per case (torch imported
once, in the driver) and writes ``{case: [problems]}`` per surviving rank to ``OUT.<case>.rank<r>``.

Cases (stage, precision, scenario):

- ``drop``: 3 ranks, each its own node, train with a :class:`BuddyCopies`; every holder's copy equals its ward's live
  state bitwise (copies stepped on the copies' thread; at stage 1 inside ``opt.step()``); rank 2 SIGKILLs itself;
  ranks 0 and 1 form a new group in the same processes, build a fresh optimizer (another seed) and
  :func:`reshard_from` their holdings; the state equals the step-K state bitwise (what a DCP reshard restores), then
  two more steps at world 2 end where plain torch from that state ends, within the ``ez_numerics`` rule, with copies
  for the new world (a new BuddyCopies, mirrored with the moments) equal to their wards' state bitwise again.
- ``join``: ranks 0 and 1 train at world 2 (stage 2) with copies; rank 2 joins: the new optimizer, at world 3 and
  ``stage'``, on all three, gets its shards from its peers (rank 2 holds nothing); bitwise, then two steps at world 3.
- ``lose2``: ranks 1 and 2 both die: rank 1's copy was on rank 2, so rank 0's :func:`reshard_from` returns a
  :class:`Fallback` naming it and leaves the new optimizer untouched.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))  # the checkpoint tests' model
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/

import torch
import torch.distributed as dist
from ckpt_model import PlainState, build, continue_plainly, full_state, mismatches, train

from elasticzero.engine.zero.comm.backends import wire_for
from elasticzero.engine.zero.comm.communicator import Communicator
from elasticzero.live.copies import BuddyCopies
from elasticzero.live.reshard import Fallback, Holdings, ReshardPlan, Seed, reshard_from
from ez_numerics import error_ratio
from ez_testing import free_port

K = 3  # steps before the membership change
CASES = [
    (1, "fp32", "drop", 1),
    (2, "fp32", "drop", 2),
    (3, "fp32", "drop", 3),
    (2, "bf16", "drop", 2),
    (3, "bf16", "drop", 3),
    (2, "fp32", "join", 3),
    (2, "fp32", "lose2", 2),
    (2, "fp32", "grow", 2),
    (1, "fp32", "grow", 2),
]


def copies_problems(rep: BuddyCopies, full: dict[str, torch.Tensor]) -> list[str]:
    """Where a copy this rank holds differs (bitwise) from its ward's live state (``full``: every rank's, gathered)."""
    bad = []
    for ward, st in rep.held().items():
        for name, chunk in st.params.items():
            got = {"": chunk.tensor, **{f".{k}": c.tensor for k, c in st.optim_state[name].items()}}
            for suffix, t in got.items():
                want = full[name + suffix][chunk.offset : chunk.offset + t.numel()]
                if not torch.equal(t, want):
                    bad.append(f"copy of rank {ward}: {name}{suffix}")
        if any(v != full[f"{n}.step"].item() for n, v in st.scalars.get("step", {}).items()):
            bad.append(f"copy of rank {ward}: step")
    return bad


def continuation(opt: Any, saved: dict[str, torch.Tensor], frozen: torch.Tensor, prec: str) -> list[str]:
    """Two more steps at the new world: off the float64 truth (plain torch from the step-K state, the same slices)
    by at most what rounding moved plain torch in the run's precision (``ez_numerics``: 3x, the fp64_ref rule)."""
    train(opt, range(K, K + 2))
    got = opt.full_state_dict()
    start, m = PlainState.of(saved), opt.world_size
    truth = continue_plainly(start, frozen, K, range(K, K + 2), m, "fp64")
    ref = continue_plainly(start, frozen, K, range(K, K + 2), m, prec)
    ratio = error_ratio({k: got[k] for k in truth}, ref, truth)
    return [] if ratio <= 1 else [f"continued state off by {ratio:.3g}x the rounding scale of {prec}"]


class Recording(Communicator):
    """The real communicator (real gloo), noting the device of every tensor handed to it: each must be on the wire
    (``comm.wire_for``), or an NCCL group would be handed a host tensor."""

    def __init__(self, group: Any) -> None:
        super().__init__(group, owner="Recording")
        self.devices: list[tuple[str, torch.device]] = []

    def exchange(self, sends: Any, recvs: Any, **kw: Any) -> Any:
        self.devices += [("exchange", t.device) for t, _ in (*sends, *recvs)]
        return super().exchange(sends, recvs, **kw)

    def all_reduce(self, tensor: torch.Tensor, **kw: Any) -> Any:
        self.devices.append(("all_reduce", tensor.device))
        return super().all_reduce(tensor, **kw)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, **kw: Any) -> Any:
        self.devices += [("all_gather", output.device), ("all_gather", input.device)]
        return super().all_gather(output, input, **kw)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int, **kw: Any) -> None:
        self.devices.append(("broadcast", tensor.device))
        super().broadcast(tensor, src_group_rank, **kw)


def off_wire(what: str, rec: Recording, wire: torch.device, ops: set[str]) -> list[str]:
    """Problems: a tensor ``rec`` was handed off ``wire``, or none of ``ops`` seen (the check would be empty)."""
    seen = {op for op, _ in rec.devices}
    off = sorted({f"{op} on {d}" for op, d in rec.devices if d != wire})
    return [f"{what}: off the wire {wire}: {o}" for o in off] + [f"{what}: no {op}" for op in sorted(ops - seen)]


def wait_for(paths: list[Path], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {paths}")
        time.sleep(0.01)


def drop(case: tuple[Any, ...], rank: int, work: Path) -> list[str]:
    s, prec, scenario, s_new = case
    opt = build(s, prec, None, seed=1)
    rep = BuddyCopies(opt, nodes=[0, 1, 2], overlap=s != 1)  # stage 1: the copies step inside opt.step()
    rep.communicator.close()
    rep.communicator = recorded = Recording(opt.process_group)  # the step's messages: on the wire
    train(opt, range(K))
    saved = full_state(opt)
    frozen = opt.full_state_dict()["frozen.weight"]
    problems = copies_problems(rep, saved)
    problems += off_wire("copies", recorded, rep.wire, {"exchange", "all_reduce"})
    (work / f"ready{rank}").touch()
    dead = [2] if scenario == "drop" else [1, 2]
    if rank in dead:
        wait_for([work / f"ready{r}" for r in range(3)])
        os.kill(os.getpid(), signal.SIGKILL)
    rep.close()
    survivors = [r for r in range(3) if r not in dead]
    group = dist.new_group(survivors, use_local_synchronization=True)
    fresh = build(s_new, prec, group, seed=2)
    before = full_state(fresh)
    fresh.communicator = moved = Recording(group)  # the reshard's messages: on the wire
    plan = reshard_from(fresh, rep.holdings())
    if scenario == "lose2":
        want = Fallback("both copies of the state of old rank(s) [1] are lost", (1,))
        problems += [] if plan == want else [f"expected {want}, got {plan}"]
        return problems + [f"touched by a fallback: {k}" for k in mismatches(fresh, before)]
    if not isinstance(plan, ReshardPlan) or plan.step != K:
        return problems + [f"reshard: {plan}"]
    problems += [f"not bit-exact after the reshard: {k}" for k in mismatches(fresh, saved)]
    problems += off_wire("reshard", moved, wire_for(moved.backend, fresh.device), {"exchange", "broadcast"})
    again = BuddyCopies(fresh, nodes=survivors, step=plan.step)  # copies for the new world, mirrored with moments
    problems += continuation(fresh, saved, frozen, prec)
    problems += [f"new world: {p}" for p in copies_problems(again, full_state(fresh))]
    census = again.census()
    again.close()
    return problems + ([] if set(census.values()) == {K + 2} else [f"census after two more steps: {census}"])


def join(case: tuple[Any, ...], rank: int, work: Path) -> list[str]:
    s, prec, _, s_new = case
    old_group = dist.new_group([0, 1])
    box: list[Any] = [None]
    holdings = Holdings()
    problems: list[str] = []
    if rank < 2:
        opt = build(s, prec, old_group, seed=1)
        rep = BuddyCopies(opt, nodes=[0, 1])
        train(opt, range(K))
        saved = full_state(opt)
        problems += copies_problems(rep, saved)
        rep.close()
        # rank 1 as a survivor that wraps its model again in place: its masters copied aside (each bucket's in one)
        holdings = rep.holdings().detached() if rank == 1 else rep.holdings()
        box = [(saved, opt.full_state_dict()["frozen.weight"])]
    dist.broadcast_object_list(box, src=0)
    saved, frozen = box[0]
    fresh = build(s_new, prec, None, seed=2 + rank)
    plan = reshard_from(fresh, holdings)
    if not isinstance(plan, ReshardPlan) or plan.step != K or plan.sources != {0: 0, 1: 1}:
        return problems + [f"reshard: {plan}"]
    problems += [f"not bit-exact after the reshard: {k}" for k in mismatches(fresh, saved)]
    return problems + continuation(fresh, saved, frozen, prec)


def grow(case: tuple[Any, ...], rank: int, work: Path) -> list[str]:
    """1 -> 2: rank 0 trains alone, rank 1 joins (rank 2 only takes part in making the groups). Rank 0 sends rank 1
    its whole state in the reshard, so it makes rank 1's first copy from the same elements (seeded, not mirrored
    back) while rank 1 gets rank 0's by the mirror; both copies equal their wards' state bitwise, then and after two
    more steps (the seeded copy's optimizer state is its own: its step counters too)."""
    s, prec, _, s_new = case
    alone, pair = dist.new_group([0]), dist.new_group([0, 1])
    if rank == 2:
        return []
    box: list[Any] = [None]
    holdings = Holdings()
    if rank == 0:
        opt = build(s, prec, alone, seed=1)
        rep = BuddyCopies(opt, nodes=[0])  # one node: no copies, its own state held
        train(opt, range(K))
        rep.close()
        holdings = rep.holdings()
        box = [(full_state(opt), opt.full_state_dict()["frozen.weight"])]
    dist.broadcast_object_list(box, src=0, group=pair)
    saved, frozen = box[0]
    fresh = build(s_new, prec, pair, seed=2 + rank)
    plan = reshard_from(fresh, holdings)
    if not isinstance(plan, ReshardPlan) or plan.step != K or plan.sources != {0: 0}:
        return [f"reshard: {plan}"]
    problems = [f"not bit-exact after the reshard: {k}" for k in mismatches(fresh, saved)]
    again = BuddyCopies(fresh, nodes=[0, 1], step=plan.step, seed=Seed(plan, holdings.states))
    want = {0: {1}, 1: set()}[rank]
    problems += [] if set(again.seeded) == want else [f"seeded {sorted(again.seeded)}, expected {sorted(want)}"]
    problems += [f"first copies: {p}" for p in copies_problems(again, full_state(fresh))]
    problems += continuation(fresh, saved, frozen, prec)
    problems += [f"after two steps: {p}" for p in copies_problems(again, full_state(fresh))]
    census = again.census()
    again.close()
    return problems + ([] if set(census.values()) == {K + 2} else [f"census after two more steps: {census}"])


def child(case: tuple[Any, ...], rank: int, port: str, out: Path) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="3")
    name = "_".join(map(str, case))
    work = Path(f"{out}.{name}.d")
    try:
        dist.init_process_group("gloo")
        problems = {"join": join, "grow": grow}.get(case[2], drop)(case, rank, work)
        Path(f"{out}.{name}.rank{rank}").write_text(json.dumps(problems))
        return 0
    except BaseException:
        Path(f"{out}.{name}.err{rank}").write_text(traceback.format_exc())
        return 1


def run_case(case: tuple[Any, ...], out: Path) -> None:
    """Fork the case's three ranks and wait for them: the ones the case kills must die of SIGKILL, the others exit 0
    (they leave without tearing down the default group, which has a dead member)."""
    Path(f"{out}.{'_'.join(map(str, case))}.d").mkdir()
    port, pids = str(free_port()), []
    for r in range(3):
        pid = os.fork()
        if pid == 0:
            os._exit(child(case, r, port, out))
        pids.append(pid)
    dead = {"drop": [2], "lose2": [1, 2], "join": [], "grow": []}[case[2]]
    for r, pid in enumerate(pids):
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        want = -signal.SIGKILL if r in dead else 0
        if code != want:
            err = Path(f"{out}.{'_'.join(map(str, case))}.err{r}")
            raise RuntimeError(f"{case} rank {r} exited {code}: {err.read_text() if err.exists() else ''}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for c in CASES:
        run_case(c, Path(sys.argv[1]))
