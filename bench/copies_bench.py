"""The cost of buddy copies (live/copies.py): step time with and without a ``BuddyCopies``, bytes the copies
send per step per rank beside the training collectives', host memory of the copies per rank.

Two gloo ranks on 127.0.0.1, each told it is its own node (``nodes=[0, 1]``: each holds the other's copy), forked
from this driver (torch imported once). Each round runs every arm in the same rank processes, the order rotated
(round 1: off then on; round 2: on then off...), so a drift of the machine's load does not favour one arm; the step
time is the median over every timed step of every round. Arms: ``off`` (no copies), ``on`` (copies, gradients sent
during backward: ``BuddyCopies(early=True)``), with ``--compare-late`` also ``late`` (``early=False``: every gradient
at the pre-step hook, the path before the overlap). ``overhead_pct_by_round``: each round's ratio of its arms (seconds
apart), whose spread is the machine's drift — on a shared 2-core machine wider than the copies' cost. Not a test:
nothing asserts, every number is this run's.

    .venv/bin/python bench/copies_bench.py                       # small GPT (~3.4M), ZeRO-2, fp32
    .venv/bin/python bench/copies_bench.py --size bench --stage 1 --rounds 3   # the 29.5M GPT of the issue's goal
    .venv/bin/python bench/copies_bench.py --size bench --compare-late --rounds 3  # + copies sent at the step only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE.parent / "tests")]

import torch  # noqa: E402

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3  # noqa: E402
from elasticzero.live.copies import BuddyCopies  # noqa: E402
from forked_ranks import result_path, run_forked, save  # noqa: E402
from gpt import GPT, config_for  # noqa: E402

STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="GPT size of examples/gpt.py (tiny, small, bench)")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per arm per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--compare-late",
        action="store_true",
        help="a third arm: copies with every gradient sent at the pre-step hook (BuddyCopies(early=False))",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/copies_bench-<utc>.json)")
    return p.parse_args(argv)


def timed_steps(
    opt: Any, model: Any, args: argparse.Namespace, n: int, seed: int, passes: list[float] | None = None
) -> list[float]:
    """Step times (seconds); ``passes`` gets each step's forward + backward time (the early sends run in it)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    times = []
    for _ in range(n):
        x = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
        t0 = time.perf_counter()
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.roll(x, 1, 1).reshape(-1)).backward()
        if passes is not None:
            passes.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def per_step_bytes(stats: Any, ops: tuple[str, ...], tags: tuple[str, ...], steps: int) -> float:
    return sum(b for (op, tag), b in stats.bytes.items() if op in ops and tag in tags) / steps


class HookClock:
    """Time the copies' own hooks: step hooks registered before it (``*_first``) and after it (``*_then``)
    bracket its pre-step (exchange + gate) and post-step (shadow steps) work, the time the copies add to the step's
    critical path — measured directly, so it is not lost in the noise of two step-time medians on a loaded machine."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {k: [] for k in ("pre_first", "pre_then", "post_first", "post_then")}

    def mark(self, kind: str) -> Any:
        return lambda *_: self.t[kind].append(time.perf_counter())

    def clear(self) -> None:
        for v in self.t.values():
            v.clear()

    def spans(self) -> dict[str, list[float]]:
        """Per step: the exchange + gate, the owner's step, the shadow steps (seconds)."""
        t = self.t
        return {
            "copies_pre": [b - a for a, b in zip(t["pre_first"], t["pre_then"], strict=True)],
            "own_step": [b - a for a, b in zip(t["pre_then"], t["post_first"], strict=True)],
            "copies_post": [b - a for a, b in zip(t["post_first"], t["post_then"], strict=True)],
        }


#: the arms: no copies; copies with the gradients sent during backward (``early``); copies sent at the pre-step hook
ARMS = {"off": None, "on": True, "late": False}


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(config_for(args.size))
    opt = STAGES[args.stage](model, torch.optim.AdamW, lr=1e-3, precision=args.precision)
    arms = ["off", "on", "late"] if args.compare_late else ["off", "on"]
    out: dict[str, Any] = {arm: [] for arm in arms} | {f"{arm}_fwd_bwd": [] for arm in arms}
    clock = HookClock()
    opt.optim.register_step_pre_hook(clock.mark("pre_first"))
    opt.optim.register_step_post_hook(clock.mark("post_first"))
    for rnd in range(args.rounds):
        for arm in arms[rnd % len(arms) :] + arms[: rnd % len(arms)]:  # rotated: no arm always first
            rep, handles = None, []
            if ARMS[arm] is not None:
                rep = BuddyCopies(opt, nodes=[0, 1], early=bool(ARMS[arm]))
                handles = [
                    opt.optim.register_step_pre_hook(clock.mark("pre_then")),
                    opt.optim.register_step_post_hook(clock.mark("post_then")),
                ]
            timed_steps(opt, model, args, args.warmup, seed=rnd)
            opt.comm_stats.reset()
            if rep is not None:
                rep.comm_stats.reset()
            clock.clear()
            out[arm] += timed_steps(opt, model, args, args.steps, seed=100 + rnd, passes=out[f"{arm}_fwd_bwd"])
            if rep is not None:
                record_copies(out, "" if arm == "on" else f"{arm}_", clock, rep, args.steps)
                rep.close()
            else:
                out["train_buffers"] = per_step_bytes(
                    opt.comm_stats, ("reduce_scatter", "all_gather"), ("grad", "param"), args.steps
                )
            for h in handles:
                h.remove()
    out["state_bytes"] = opt.memory_report()["total"]
    out["numel"] = opt.numel
    return out


def record_copies(out: dict[str, Any], prefix: str, clock: HookClock, rep: BuddyCopies, steps: int) -> None:
    """Add one arm's hook spans, bytes and steps sent early to ``out`` (keys ``prefix`` + name)."""
    spans = clock.spans()
    spans["copies"] = [a + b for a, b in zip(spans["copies_pre"], spans["copies_post"], strict=True)]
    for k, v in spans.items():
        out[prefix + k] = out.get(prefix + k, []) + v
    out[prefix + "copies_sent"] = per_step_bytes(rep.comm_stats, ("send",), ("copies",), steps)
    out["copies_host_bytes"] = rep.nbytes()
    out[prefix + "early_steps"] = out.get(prefix + "early_steps", 0) + rep.early_steps


def median_ms(ranks: list[dict[str, Any]], key: str) -> float:
    """Median over every rank's samples of ``key`` (seconds), in milliseconds."""
    return 1e3 * statistics.median(t for r in ranks for t in r[key])


def by_round(ranks: list[dict[str, Any]], key: str, steps: int) -> list[float]:
    """Per round, the median over every rank's timed steps of ``key`` in that round (seconds)."""
    rounds = len(ranks[0][key]) // steps
    return [statistics.median(t for r in ranks for t in r[key][i * steps : (i + 1) * steps]) for i in range(rounds)]


def round_overheads(ranks: list[dict[str, Any]], arm: str, steps: int) -> list[float]:
    """Per round, ``arm``'s step time over ``off``'s in the same round, in percent: the arms of a round run minutes
    apart at most, so the spread of these is the machine's drift the one median of all rounds carries too."""
    pairs = zip(by_round(ranks, arm, steps), by_round(ranks, "off", steps), strict=True)
    return [round(100 * (a / b - 1), 1) for a, b in pairs]


def summary(ranks: list[dict[str, Any]], world: int, steps: int) -> dict[str, Any]:
    off, on = median_ms(ranks, "off"), median_ms(ranks, "on")
    copies = median_ms(ranks, "copies")
    train_sent = max(r["train_buffers"] for r in ranks) * (world - 1) / world  # a ring sends (N-1)/N of each buffer
    res = {
        "params": ranks[0]["numel"],
        "step_ms_off": off,
        "step_ms_on": on,
        "overhead_pct": 100 * (on / off - 1),
        "overhead_pct_by_round": round_overheads(ranks, "on", steps),
        "copies_ms": copies,
        "copies_pct_of_off": 100 * copies / off,
        "copies_exchange_gate_ms": median_ms(ranks, "copies_pre"),
        "copies_shadow_step_ms": median_ms(ranks, "copies_post"),
        "own_optimizer_step_ms": median_ms(ranks, "own_step"),
        "fwd_bwd_ms_off": median_ms(ranks, "off_fwd_bwd"),
        "fwd_bwd_ms_on": median_ms(ranks, "on_fwd_bwd"),
        "copies_sent_bytes_per_step": max(r["copies_sent"] for r in ranks),
        "train_sent_bytes_per_step": train_sent,
        "copies_host_bytes": max(r["copies_host_bytes"] for r in ranks),
        "model_state_bytes": max(r["state_bytes"] for r in ranks),
        "early_steps": min(r["early_steps"] for r in ranks),  # steps (warm-up too) sent during backward
    }
    if "late" in ranks[0]:
        late = median_ms(ranks, "late")
        res |= {
            "step_ms_late": late,
            "late_overhead_pct": 100 * (late / off - 1),
            "late_overhead_pct_by_round": round_overheads(ranks, "late", steps),
            "late_exchange_gate_ms": median_ms(ranks, "late_copies_pre"),
            "fwd_bwd_ms_late": median_ms(ranks, "late_fwd_bwd"),
            "late_early_steps": min(r["late_early_steps"] for r in ranks),
        }
    return res


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = result_path(args.out, "copies_bench")
    ranks = run_forked(2, lambda rank, a: rank_main(a), args, out)
    summed = summary(ranks, 2, args.steps)
    save(out, args, summed, ranks)
    for k, v in summed.items():
        print(f"{k:32s} {v}" if isinstance(v, list) else f"{k:32s} {v:,.1f}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
