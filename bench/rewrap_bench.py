"""A live survivor's round change, its local part: the old optimizer handed the model back, a new one built on it, the
state filled in, the first step — with a copy of the model (``unwrap()``, the path before) and in place
(``unwrap(copy=False)``, the held master shard and module state copied aside: :meth:`ShardedState.detached`; the new
optimizer takes over the buffers the parameters lie flat in).

One process, a world of one (gloo): what the two paths do differently is local — memory copied and touched afresh —
and the module's broadcast, the reshard's transfers and the copies' mirror (the same collectives in both) are left
out. The fill is the reshard's local path (every element its own: a template filled from the held state, then
loaded). Arms alternate rep by rep, each on the other's model of the rep before (the old optimizer of a survivor is
always the one it trained with); medians per phase, the in-place arm's as a ratio of the copy's. (Memory is not
reported: the resident set's growth over a change depends on what the allocator kept of the rep before.) Not a test:
nothing asserts, every number is this run's.

    .venv/bin/python bench/rewrap_bench.py --size bench --reps 5           # the 25.5M GPT
    .venv/bin/python bench/rewrap_bench.py --size large --reps 5 --stage 1 # 85.5M, ZeRO-1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE.parent / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elasticzero import ZeroStage1, ZeroStage2  # noqa: E402
from elasticzero.engine.zero.dcp_state import ZeroCheckpointState  # noqa: E402
from ez_ports import free_port  # noqa: E402
from gpt import GPT, config_for  # noqa: E402

STAGES = {1: ZeroStage1, 2: ZeroStage2}
ARMS = ("copy", "in place")
PHASES = ("read", "unwrap", "build", "fill", "first step", "next step")
VOCAB, SEQ, BATCH = 256, 32, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="bench", help="examples/gpt.py size (tiny, small, bench, large, ...)")
    p.add_argument("--stage", type=int, choices=sorted(STAGES), default=2)
    p.add_argument("--reps", type=int, default=5, help="round changes per arm")
    return p.parse_args(argv)


def step(model: torch.nn.Module, opt: Any, x: torch.Tensor) -> None:
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), x.view(-1)).backward()
    opt.step()
    opt.zero_grad()


def fill(opt: Any, held: Any) -> None:
    """The reshard's local path: a template of ``opt`` filled from ``held`` (same layout: every element its own),
    then loaded."""
    state = ZeroCheckpointState(opt)
    template, src = state.load_template(), held.state_dict()
    for name, chunk in template["params"].items():
        chunk.tensor.copy_(src["params"][name].tensor)
    for name, by_key in template["optim"]["state"].items():
        for key, chunk in by_key.items():
            chunk.tensor.copy_(src["optim"]["state"][name][key].tensor)
    state.load_state_dict(template)


def change(arm: str, opt: Any, stage: Any, x: torch.Tensor) -> tuple[Any, dict[str, float]]:
    """One round change of ``arm`` from ``opt``: the new optimizer and each phase's seconds."""
    gc.collect()
    times: dict[str, float] = {}

    def timed(name: str, work: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = work()
        times[name] = time.perf_counter() - t0
        return out

    in_place = arm == "in place"
    held = timed("read", lambda: opt.sharded_state().detached() if in_place else opt.sharded_state())
    model = timed("unwrap", lambda: opt.unwrap(copy=not in_place))
    new = timed("build", lambda: stage(model, torch.optim.AdamW, lr=1e-4))
    timed("fill", lambda: fill(new, held))
    timed("first step", lambda: step(model, new, x))
    timed("next step", lambda: step(model, new, x))
    return new, times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT(config_for(args.size, vocab_size=VOCAB, block_size=SEQ))
    stage = STAGES[args.stage]
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    opt = stage(model, torch.optim.AdamW, lr=1e-4)
    step(model, opt, x)
    numel = sum(p.numel() for p in model.parameters())
    print(f"rewrap_bench: {numel / 1e6:.1f}M GPT ({args.size}), ZeRO-{args.stage} fp32, world 1, {args.reps} reps")
    seen: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for rep in range(args.reps):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            opt, times = change(arm, opt, stage, x)
            seen[arm].append(times)
    print(f"{'phase (median s)':<18}" + "".join(f"{arm:>12}" for arm in ARMS) + f"{'ratio':>10}")
    for phase in PHASES:
        a, b = (statistics.median(t[phase] for t in seen[arm]) for arm in ARMS)
        print(f"{phase:<18}{a:>12.3f}{b:>12.3f}{b / a if a else float('nan'):>10.2f}")
    entry = [sum(t[p] for p in ("read", "unwrap", "build", "fill")) for t in seen[ARMS[0]]]
    kept = [sum(t[p] for p in ("read", "unwrap", "build", "fill")) for t in seen[ARMS[1]]]
    a, b = statistics.median(entry), statistics.median(kept)
    print(f"{'entry (to fill)':<18}{a:>12.3f}{b:>12.3f}{b / a:>10.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
