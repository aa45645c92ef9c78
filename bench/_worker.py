"""One rank of one benchmark peer (started by ``bench/engine_bench.py``; RANK/WORLD_SIZE/MASTER_* come from env).

Phases: warm-up steps; timed steps (wall time per step, or on CUDA the GPU time between timing events: no
synchronisation inside the steps); peak RSS (VmHWM) and, on CUDA, peak allocated device memory over the timed steps;
one step with held-tensor scans after backward and after the optimizer step; ``--comm-steps`` steps with the
collective counter on. Writes one JSON file. ``--device cuda`` runs on this rank's GPU (``LOCAL_RANK``) over NCCL.
Runs under the project's venv or the optional DeepSpeed venv, so it imports only torch, stdlib and examples/gpt.py
(``--model llama`` also imports ``transformers``: a Hugging Face Llama built from a config, random init)."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "src")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _measure import COUNTER, StepClock, held_tensor_bytes, peak_memory_bytes, proc_status_kib, reset_peak_memory  # noqa: E402

COUNTER.install()  # before any engine import, so `from torch.distributed import X` in engines gets the wrapper

import _peers  # noqa: E402
from gpt import GPT, GPTConfig, config_for, lm_loss, num_params, synthetic_batch  # noqa: E402


def parse_args() -> argparse.Namespace:
    """Worker flags (set by the driver)."""
    p = argparse.ArgumentParser()
    p.add_argument("--peer", required=True, choices=_peers.ALL_PEERS)
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
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--adamw", default="fused", choices=["fused", "default"], help="every peer's AdamW implementation")
    p.add_argument("--profile-dir", type=Path, default=None, help="torch.profiler over 2 more steps: table + trace")
    return p.parse_args()


def model_config(size: str, seq_len: int) -> GPTConfig:
    """``examples/gpt.py``'s named size, or one of ``_peers.GPU_SIZES`` over its ``bench`` size; the block holds
    ``seq_len`` tokens."""
    base, shape = ("bench", _peers.GPU_SIZES[size]) if size in _peers.GPU_SIZES else (size, {})
    return config_for(base, **shape, block_size=max(seq_len, config_for(base).block_size))


def device_of(kind: str) -> torch.device:
    """This rank's device: the CPU, or GPU ``LOCAL_RANK`` (made current)."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def run(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """Build the peer, run every phase, return this rank's measurements."""
    rss_start = proc_status_kib("VmRSS")
    cfg = model_config(args.size, args.seq_len)
    setting = _peers.Setting(device_of(args.device), args.precision, args.adamw)
    torch.manual_seed(args.seed)
    model: torch.nn.Module
    with setting.device:  # parameters made (and initialised) on the device
        if args.model == "llama":
            model, model_info = hf_llama(args.seq_len)
            cfg = dataclasses.replace(cfg, vocab_size=model_info["vocab_size"])
        else:
            model, model_info = GPT(cfg), {"size": args.size, **cfg.__dict__}
    psi = num_params(model)
    x, y = synthetic_batch(cfg, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed + 1 + rank))
    x, y = x.to(setting.device), y.to(setting.device)
    peer = _peers.build(args.peer, model, args.lr, args.bucket_mb, args.batch_size, setting)
    torch.set_num_threads(_peers.host_threads(args.peer, world, os.cpu_count()))  # engines may reset it at init
    clock = StepClock(setting.device)

    def one_step(timed: bool = False) -> torch.Tensor:
        if timed:
            clock.mark()
        with peer.autocast():
            loss = lm_loss(peer.net(x), y)
        if timed:
            clock.mark()
        peer.backward(loss)
        if timed:
            clock.mark()
        peer.step()
        peer.zero_grad()
        return loss.detach()

    losses: list[float] = []
    cpu_times: list[float] = []
    frames = compile_frames(args.peer)
    for _ in range(args.warmup):
        losses.append(float(one_step()))
    frames_warmup = compile_frames(args.peer)
    reset_peak_memory(setting.device)
    timed_losses = []
    for _ in range(args.steps):
        c0 = time.process_time()
        timed_losses.append(one_step(timed=True))  # no .item() here: on CUDA it would synchronise every step
        cpu_times.append(time.process_time() - c0)  # all threads of this rank; less sensitive to other load
    frames_timed = compile_frames(args.peer)
    clock.mark()  # marks: start, after forward, after backward of each step, then the end; read once
    intervals = clock.intervals()
    phase_times = [intervals[i : i + 3] for i in range(0, len(intervals), 3)]  # the step phase runs to the next start
    times = [sum(phases) for phases in phase_times]
    losses += [float(v) for v in timed_losses]
    vmhwm = proc_status_kib("VmHWM")
    peak_mem = peak_memory_bytes(setting.device)

    # held tensors: after backward (full/sharded grads present) and after the step (before zero_grad)
    with peer.autocast():
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
        losses.append(float(one_step()))
    COUNTER.enabled = False
    engine_comm = None
    if peer.engine_comm and engine_before is not None:
        after = peer.engine_comm()
        engine_comm = {op: (n - engine_before.get(op, 0)) / args.comm_steps for op, n in after.items()}
    profile_error = None
    if args.profile_dir is not None:
        try:  # optional: a profiler problem costs the profile, not the measurements above
            profile(args.profile_dir / f"{args.peer}.rank{rank}", setting.device, one_step)
        except Exception as exc:
            profile_error = f"{type(exc).__name__}: {exc}"
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
        "peak_device_bytes": peak_mem,
        "device": str(setting.device),
        "precision": setting.precision,
        "rss_start_kib": rss_start,
        "rss_end_kib": proc_status_kib("VmRSS"),
        "torch": torch.__version__,
        "info": peer.info,
        "compile_frames": None
        if frames is None
        else {"warmup": frames_warmup - frames, "timed": frames_timed - frames_warmup},
        "profile_error": profile_error,
    }


def compile_frames(peer: str) -> int | None:
    """Frames Dynamo has compiled in this process (a compiled peer's timed steps should add none), else None."""
    if not peer.endswith(_peers.COMPILED_SUFFIX):
        return None
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def profile(stem: Path, device: torch.device, step: Callable[[], object], steps: int = 2) -> None:
    """``torch.profiler`` over ``steps`` more steps (after every measurement): ``<stem>.txt``, the operators by self
    time (device time on CUDA), and ``<stem>.trace.json``, a Chrome/Perfetto trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    stem.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    (stem.parent / f"{stem.name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=25))
    prof.export_chrome_trace(str(stem.parent / f"{stem.name}.trace.json"))


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
        device_of(args.device)  # the current GPU before NCCL starts
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            result = run(args, rank, world)
        finally:
            dist.destroy_process_group()
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
