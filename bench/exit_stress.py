"""Stress the exit-time abort (docs/engine.md, Limits: "Process exit and the backend's threads"): run N two-rank
jobs of a Hugging Face Llama under ZeroStage3 in bf16 — training with clipping, an evaluation forward under
``no_grad``, ``generate()``, ``full_state_dict()``, the script's own loss all-reduce — beside CPU-burning processes,
and count the ranks that end with SIGABRT / ``terminate called without an active exception``.

Not a test (it runs minutes); the count goes in the issue's closing note::

    .venv/bin/python bench/exit_stress.py --runs 300 --load 2          # the proof run
    .venv/bin/python bench/exit_stress.py --runs 20 --load 2 --budget 480   # a bounded smoke

Each run is two fresh processes (``python bench/exit_stress.py --rank R ...``) rendezvousing over a TCPStore whose
listening socket the parent binds and hands to rank 0 (no free-port race with parallel instances), so the
interpreter's real exit path is exercised. Failed runs print both ranks' exit codes and stderr tails as they happen.
``--budget`` stops starting runs after that many seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

ABORT_TEXT = b"terminate called"


@dataclass
class Tally:
    runs: int = 0
    aborts: int = 0
    other_failures: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, codes: list[int], errs: list[bytes]) -> None:
        self.runs += 1
        aborted = [c == -6 or ABORT_TEXT in e for c, e in zip(codes, errs, strict=True)]
        if any(aborted):
            self.aborts += 1
        elif any(codes):
            self.other_failures += 1
        if any(codes) and len(self.examples) < 3:
            self.examples.append(
                f"codes={codes} stderr tail: {errs[codes.index(next(c for c in codes if c))][-600:]!r}"
            )


def burn() -> None:
    """A CPU-bound loop (the 'loaded machine')."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % (1 << 31)


def rank_main(rank: int, world: int, steps: int) -> None:
    """One rank of one run; mirrors a user's script end to end, then returns to the interpreter's exit."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import torch.distributed as dist
    import transformers

    import elasticzero

    torch.set_num_threads(1)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listen_fd = int(os.environ.get("EZ_STRESS_LISTEN_FD", "-1"))  # rank 0: the socket the parent bound for it
    store = dist.TCPStore(host, port, world, rank == 0, master_listen_fd=listen_fd if rank == 0 else None)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)
    opt = elasticzero.ZeroStage3(model, torch.optim.AdamW, lr=1e-3, precision="bf16")
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the script's own logging collective
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
        model.generate(ids[:1, :4], max_new_tokens=2 + rank, do_sample=False, pad_token_id=0)
    opt.full_state_dict()
    dist.destroy_process_group()


def one_run(steps: int, timeout: float) -> tuple[list[int], list[bytes]]:
    # the parent binds the store's port and hands the listening socket to rank 0: no free-port race with other jobs
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port, fd = listener.getsockname()[1], listener.fileno()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(r), "--world", "2", "--steps", str(steps)],
                env={**env, "EZ_STRESS_LISTEN_FD": str(fd)} if r == 0 else env,
                pass_fds=(fd,) if r == 0 else (),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for r in range(2)
        ]
    codes, errs = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += b"\n[exit_stress] timed out"
        codes.append(p.returncode)
        errs.append(err)
    return codes, errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=2, help="CPU-burning processes beside the runs")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; stop starting runs after this (0: none)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run (a hang, not a slow run)")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        rank_main(args.rank, args.world, args.steps)
        return
    import multiprocessing

    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    tally, start = Tally(), time.monotonic()
    try:
        for i in range(args.runs):
            if args.budget and time.monotonic() - start > args.budget:
                break
            codes, errs = one_run(args.steps, args.timeout)
            tally.add(codes, errs)
            print(f"run {i + 1}: aborts {tally.aborts}, other failures {tally.other_failures}", flush=True)
            for rank, (code, err) in enumerate(zip(codes, errs, strict=True)):
                if code:
                    print(f"  rank {rank} exit {code}: {err[-800:].decode(errors='replace')!r}", flush=True)
    finally:
        for b in burners:
            b.terminate()
    load = os.getloadavg()
    print(
        f"exit_stress: {tally.runs} two-rank runs (Llama, ZeroStage3, bf16), {tally.aborts} with an abort, "
        f"{tally.other_failures} other failures, {time.monotonic() - start:.0f} s, load average {load[0]:.1f}"
    )
    for e in tally.examples:
        print(e)


if __name__ == "__main__":
    main()
