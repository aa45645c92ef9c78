"""One rank of one benchmark peer (started by ``bench/engine_bench.py``; RANK/WORLD_SIZE/MASTER_* come from env).

Phases: warm-up steps; timed steps (wall time per step); peak RSS (VmHWM) read; one step with held-tensor scans after
backward and after the optimizer step; ``--comm-steps`` steps with the collective counter on. Writes one JSON file.
Runs under the project's venv or the optional DeepSpeed venv, so it imports only torch, stdlib and examples/gpt.py
(``--model llama`` also imports ``transformers``: a Hugging Face Llama built from a config, random init).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "src")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _measure import COUNTER, held_tensor_bytes, proc_status_kib  # noqa: E402

COUNTER.install()  # before any engine import, so `from torch.distributed import X` in engines gets the wrapper

import _peers  # noqa: E402
from gpt import GPT, config_for, lm_loss, num_params, synthetic_batch  # noqa: E402


def parse_args() -> argparse.Namespace:
    """Worker flags (set by the driver)."""
    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True, choices=_peers.PEERS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="bench")
    p.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--comm-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def run(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Build the peer, run every phase, return this rank's measurements."""
    rss_start = proc_status_kib("VmRSS")
    cfg = config_for(args.size, block_size=max(args.seq_len, config_for(args.size).block_size))
    torch.manual_seed(args.seed)
    model: torch.nn.Module
    if args.model == "llama":
        model, model_info = hf_llama(args.seq_len)
        cfg = dataclasses.replace(cfg, vocab_size=model_info["vocab_size"])
    else:
        model, model_info = GPT(cfg), {"size": args.size, **cfg.__dict__}
    psi = num_params(model)
    x, y = synthetic_batch(cfg, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed + 1 + rank))
    peer = _peers.build(args.peer, model, args.lr, args.bucket_mb, args.batch_size)
    torch.set_num_threads(1)  # engines may reset it at init

    def one_step(phases: list[float] | None = None) -> float:
        t0 = time.perf_counter()
        loss = lm_loss(peer.net(x), y)
        t1 = time.perf_counter()
        peer.backward(loss)
        t2 = time.perf_counter()
        peer.step()
        peer.zero_grad()
        if phases is not None:
            phases[:] = [t1 - t0, t2 - t1, time.perf_counter() - t2]
        return float(loss.detach())

    losses, times, cpu_times, phase_times = [], [], [], []
    for _ in range(args.warmup):
        losses.append(one_step())
    for _ in range(args.steps):
        phases: list[float] = []
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(one_step(phases))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)  # all threads of this rank; less sensitive to other load
        phase_times.append(phases)
    vmhwm = proc_status_kib("VmHWM")

    # held tensors: after backward (full/sharded grads present) and after the step (before zero_grad)
    loss = lm_loss(peer.net(x), y)
    peer.backward(loss)
    losses.append(float(loss.detach()))
    del loss
    held_bwd = held_tensor_bytes([model], exclude=(x, y))
    engine_mem = {"after_backward": peer.memory_report()} if peer.memory_report else None
    peer.step()
    held_step = held_tensor_bytes([model], exclude=(x, y))
    if engine_mem is not None and peer.memory_report:
        engine_mem["after_step"] = peer.memory_report()
    peer.zero_grad()

    engine_before = peer.engine_comm() if peer.engine_comm else None
    COUNTER.reset()
    COUNTER.enabled = True
    for _ in range(args.comm_steps):
        losses.append(one_step())
    COUNTER.enabled = False
    engine_comm = None
    if peer.engine_comm and engine_before is not None:
        after = peer.engine_comm()
        engine_comm = {op: (n - engine_before.get(op, 0)) / args.comm_steps for op, n in after.items()}
    return {
        "peer": args.peer,
        "rank": rank,
        "world_size": world,
        "params": psi,
        "model": model_info,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "step_times_s": times,
        "step_cpu_s": cpu_times,
        "phase_times_s": {k: [p[i] for p in phase_times] for i, k in enumerate(("forward", "backward", "step"))},
        "losses": losses,
        "held_bytes": {"after_backward": held_bwd, "after_step": held_step},
        "comm_elements_per_step": {op: n / args.comm_steps for op, n in COUNTER.elements.items()},
        "comm_calls_per_step": {op: n / args.comm_steps for op, n in COUNTER.calls.items()},
        "comm_paper_units_per_step": COUNTER.paper_units() / args.comm_steps,
        "engine_comm_elements_per_step": engine_comm,
        "engine_memory_report": engine_mem,
        "vmhwm_kib": vmhwm,
        "rss_start_kib": rss_start,
        "rss_end_kib": proc_status_kib("VmRSS"),
        "torch": torch.__version__,
        "info": peer.info,
    }


class LogitsOf(torch.nn.Module):
    """A Hugging Face causal LM as the bench's ``net(x) -> logits``; ``blocks`` (not registered twice) are its decoder
    layers, which FSDP2 shards one by one as it does the GPT's blocks (and ZeroStage3's default units pick too)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm
        object.__setattr__(self, "blocks", lm.model.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x, use_cache=False).logits


def hf_llama(seq_len: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Llama-style model of ~31M parameters (8 layers, hidden 512, grouped-query attention 8/4 heads)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max(seq_len, 128),
    )
    info = {"model": "transformers.LlamaForCausalLM", "transformers": transformers.__version__, **cfg.to_diff_dict()}
    return LogitsOf(transformers.LlamaForCausalLM(cfg)), {**info, "vocab_size": cfg.vocab_size}


def main() -> int:
    """Preflight (both ranks agree to skip without any collective), init gloo, run, write JSON."""
    args = parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks before killing a hang
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    skip = _peers.preflight(args.peer)
    if skip:
        result: dict[str, Any] = {"peer": args.peer, "rank": rank, "skipped": skip}
    else:
        dist.init_process_group("gloo")
        try:
            result = run(args, rank, world)
        finally:
            dist.destroy_process_group()
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
