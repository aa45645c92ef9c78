"""Can a join's state transfer hide behind the survivors' forward and backward? The premise of issue 31's next step,
measured before it is built.

Today a join's survivors stop at the agreed step, reshard (the joiner's shard of the masters and both Adam moments
travels), then train at the new world: the transfer is on their pause. torchft heals a replica group the other way
(``torchft/manager.py``: the healing group receives the state while everyone runs the step's forward and backward,
contributes zero gradients, and loads the state before the optimizer step). For ZeRO with a global batch kept: the
survivors would run the switch step on the old world's split of the batch while the joiner's shard state travels,
and the step's reduction and update would run at the new world. Whether that hides the transfer depends on the
machine: on a CPU the send and the receive take cycles from the compute beside them.

Two gloo ranks on 127.0.0.1, forked from this driver. Rank 0 is the survivor: the example's GPT (``--size``, the
example's byte-level vocabulary: ``bench`` is the 25.5M model of ``live_recovery_bench.py``), forward + backward of
one world-1 step (``--global-batch`` sequences of ``--seq-len`` in micro-batches of ``--micro-batch``). Rank 1 is
the joiner: it computes nothing. The bytes are a joiner's share at 1 -> 2: half of the fp32 masters and of both
moments (1.5 x the parameters x 4 bytes), in ``--chunks`` messages (the reshard sends one per bucket run), received
into fresh memory as the reshard's template is. Arms, each round in a rotated order: ``compute`` (rank 0's forward +
backward alone), ``transfer`` (the messages alone), ``overlap`` (the sends posted, then forward + backward, then the
sends waited: the time until both are done on rank 0 and the receives on rank 1). Printed: medians over all rounds,
``hidden`` = (compute + transfer - overlap) / transfer, and the overlap step over the compute step. Not a test:
nothing asserts, every number is this run's.

    .venv/bin/python bench/join_overlap_bench.py --size bench --rounds 8
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
import torch.distributed as dist  # noqa: E402

from forked_ranks import result_path, run_forked, save  # noqa: E402
from gpt import GPT, config_for  # noqa: E402

ARMS = ("compute", "transfer", "overlap")
#: fp32 tensors a joiner's shard brings per parameter element at 1 -> 2: the master and Adam's two moments, halved
SHARE = 3 / 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", help="GPT size of examples/gpt.py at vocabulary 256 (tiny, bench, large)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--chunks", type=int, default=8, help="messages the state travels in")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/join_overlap-<utc>.json)")
    return p.parse_args(argv)


def forward_backward(model: GPT, args: argparse.Namespace, g: torch.Generator) -> None:
    """One world-1 step's forward and backward (its micro-batches), gradients dropped after."""
    vocab = model.cfg.vocab_size
    for _ in range(args.global_batch // args.micro_batch):
        x = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=g)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.roll(x, 1, 1).reshape(-1)).backward()
    model.zero_grad(set_to_none=True)


def chunk_sizes(total: int, chunks: int) -> list[int]:
    """``total`` elements in ``chunks`` messages, as even as they split."""
    return [total // chunks + (i < total % chunks) for i in range(chunks)]


def post(rank: int, sizes: list[int], held: list[torch.Tensor]) -> list[Any]:
    """Rank 0 sends ``held``; rank 1 receives into fresh buffers (the reshard's template is fresh memory too)."""
    if rank == 0:
        return [dist.isend(t, 1) for t in held]
    return [dist.irecv(torch.empty(n), 0) for n in sizes]


def arm(name: str, rank: int, model: GPT | None, args: argparse.Namespace, sizes: list[int], held: list[Any]) -> float:
    """One arm's time on this rank (seconds), between two barriers."""
    g = torch.Generator().manual_seed(0)
    dist.barrier()
    t0 = time.perf_counter()
    works = post(rank, sizes, held) if name != "compute" else []
    if model is not None and name != "transfer":
        forward_backward(model, args, g)
    for w in works:
        w.wait()
    took = time.perf_counter() - t0
    dist.barrier()
    return took


def rank_main(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = config_for(args.size, vocab_size=256, block_size=args.seq_len)  # the example's model
    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(cfg).parameters())
    model = GPT(cfg) if rank == 0 else None
    sizes = chunk_sizes(int(numel * SHARE), args.chunks)
    held = [torch.randn(n) for n in sizes] if rank == 0 else []
    out: dict[str, Any] = {a: [] for a in ARMS} | {"numel": numel, "bytes": 4 * sum(sizes)}
    for name in ARMS:  # warm-up: the first of each pays its one-time costs
        arm(name, rank, model, args, sizes, held)
    for rnd in range(args.rounds):
        for name in ARMS[rnd % len(ARMS) :] + ARMS[: rnd % len(ARMS)]:
            out[name].append(arm(name, rank, model, args, sizes, held))
    return out


def summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (ms) of each arm, the slower rank's per round; the share of the transfer hidden."""
    ms = {a: 1e3 * statistics.median(max(r[a][i] for r in ranks) for i in range(len(ranks[0][a]))) for a in ARMS}
    return {
        "params": ranks[0]["numel"],
        "state_mib": ranks[0]["bytes"] / 2**20,
        **{f"{a}_ms": v for a, v in ms.items()},
        "hidden": (ms["compute"] + ms["transfer"] - ms["overlap"]) / ms["transfer"],
        "overlap_over_compute": ms["overlap"] / ms["compute"],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = result_path(args.out, "join_overlap")
    ranks = run_forked(2, rank_main, args, out)
    summed = summary(ranks)
    save(out, args, summed, ranks)
    for k, v in summed.items():
        print(f"{k:24s} {v:,.2f}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
