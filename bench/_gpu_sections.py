"""The in-process sections of ``bench/gpu_check.py``: each runs in a child process of its own (``python
bench/_gpu_sections.py SECTION --device cuda --out FILE``), at world size 1 (NCCL on a GPU, gloo on the CPU, the
store in-process: no port), and writes one JSON result: ``checks`` (name, ok, detail) and ``data`` (figures).

- ``correctness``: ZeroStage1/2/3 against ``torch.optim.AdamW`` on the same GPT and batches, fp32 and bf16, through
  the engine's public ``optimizer_step`` with clipping active.
- ``checkpoint``: the ``Checkpointer``'s async save of a stage-2 and a stage-3 state on the device: the stall it puts
  on the training loop against a step, the steps taken while it writes, and a resume into fresh objects that is
  bit-exact with the saved state and has the parameters back on the device.
- ``offload``: ZeRO-Offload at world size 1: stages 1/2/3 offloaded against the same stage resident (fp32, the
  ez_numerics rule), the state's placement (host memory, page-locked, a copy stream) and the device memory it saves.
- ``live``: a world of one ``LiveTraining`` (live recovery's loop) on the device through two rounds written by the
  section (a round file, as the agent writes it): the round's group formed twice in one process (NCCL: the old one
  aborted, then destroyed), the state carried into an optimizer built afresh bitwise, training going on. It forms its
  own groups (no world opened for it). One GPU cannot run two NCCL ranks: the buddy copies and the reshard's transfers
  between ranks are not run here (one node: no copies; the reshard is local).

Only torch, the package, ``examples/gpt.py`` and the tests' free-port rule.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples"), str(HERE.parent / "src"), str(HERE.parent / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _measure import StepClock  # noqa: E402
from _peers import GPU_SIZES  # noqa: E402
from ez_ports import free_port  # noqa: E402
from gpt import GPT, GPTConfig, config_for, lm_loss, synthetic_batch  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]
LR, BETAS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 0.1
MAX_NORM = 0.05  # below the gradient norm of these models, so the clip changes every update (counted in the result)
FP32_EPS = 2.0**-24  # unit roundoff of fp32


def check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    """One line of the report."""
    return {"name": name, "ok": bool(ok), "detail": detail}


# -- world of one ----------------------------------------------------------------------------------------------------
def open_world(kind: str) -> torch.device:
    """World size 1 on ``kind``: GPU 0 over NCCL, or the CPU over gloo; the store is in-process (no port)."""
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def environment(device: torch.device) -> dict[str, Any]:
    """What ran: torch, CUDA, NCCL, the device."""
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    env["backend"] = dist.get_backend()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_GiB": props.total_memory / 2**30, "cuda": torch.version.cuda}
        env |= {"capability": ".".join(map(str, torch.cuda.get_device_capability(device)))}
        nccl = torch.cuda.nccl.version()  # a tuple (an int in older torch)
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return env


def gpt(cfg: GPTConfig, device: torch.device, seed: int) -> GPT:
    """The GPT of ``examples/gpt.py``, initialised on ``device`` from ``seed`` (the same weights for the same seed)."""
    torch.manual_seed(seed)
    with device:
        return GPT(cfg)


def batches(cfg: GPTConfig, n: int, size: int, seq: int, device: torch.device) -> list[Batch]:
    """``n`` fixed synthetic batches (one per step), on ``device``."""
    out = []
    for i in range(n):
        x, y = synthetic_batch(cfg, size, seq, torch.Generator().manual_seed(1000 + i))
        out.append((x.to(device), y.to(device)))
    return out


def reference_adamw(params: Any) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` built as the ZeRO stages build theirs (``optimizer_kwargs_for``: fused where the caller
    chose no implementation), so the reference runs the same element-wise kernel and stages 1/2 can equal it bitwise."""
    from elasticzero.engine.zero.inner import optimizer_kwargs_for

    kwargs = optimizer_kwargs_for(torch.optim.AdamW, {"lr": LR, "betas": BETAS, "weight_decay": WEIGHT_DECAY})
    return torch.optim.AdamW(params, **kwargs)


def zero_stage(stage: int) -> type[torch.optim.Optimizer]:
    import elasticzero

    return getattr(elasticzero, f"ZeroStage{stage}")  # type: ignore[no-any-return]


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: list[Batch],
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> list[float]:
    """One clipped step per batch through ``elasticzero.engine.optimizer_step``; the norms before clipping."""
    from elasticzero.engine import optimizer_step

    norms = []
    for x, y in data:
        with autocast():
            loss = lm_loss(model(x), y)
        loss.backward()
        result = optimizer_step(opt, max_norm=MAX_NORM)
        assert result.grad_norm is not None
        norms.append(float(result.grad_norm))
    return norms


def weights(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """fp32 weights by module key: a ZeRO stage's masters (``full_state_dict``), else the module's own."""
    full = getattr(opt, "full_state_dict", None)
    sd = full() if callable(full) else model.state_dict()
    return {k: v.detach().float().clone() for k, v in sd.items()}


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def update_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """‖Δgot - Δref‖ / ‖Δref‖ over all parameters, Δ = weights after training - initial weights: how far the
    training's total update is from the reference's (0: the same update, 1: e.g. no update at all)."""
    num = sum(float(((got[k] - start[k]) - (ref[k] - start[k])).double().square().sum()) for k in ref)
    den = sum(float((ref[k] - start[k]).double().square().sum()) for k in ref)
    return math.sqrt(num / den)


# -- correctness -----------------------------------------------------------------------------------------------------
def correctness(device: torch.device, quick: bool) -> dict[str, Any]:
    """ZeroStage1/2/3 at world size 1 against ``torch.optim.AdamW`` (same init, batches, clipping), fp32 and bf16.

    Attention runs on SDPA's math backend here: the fused CUDA attention kernels may accumulate their backward with
    atomics (run to run differences of an ulp) and a bitwise comparison of two runs needs deterministic kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return _correctness(device, quick)


def _correctness(device: torch.device, quick: bool) -> dict[str, Any]:
    cfg = config_for("tiny" if quick else "small", block_size=64)
    steps, data = 6, batches(cfg, 6, 4, 64, device)
    start = weights(gpt(cfg, device, 0))
    ref = gpt(cfg, device, 0)
    ref_norms = train(ref, reference_adamw(ref.parameters()), data)
    ref_w = weights(ref)
    clipped = sum(n > MAX_NORM for n in ref_norms)
    checks = [check("fp32 AdamW reference: clipping active", clipped == steps, f"{clipped}/{steps} steps clipped")]
    data_out: dict[str, Any] = {
        "steps": steps,
        "params": sum(v.numel() for v in start.values()),
        "ref_norms": ref_norms,
    }
    for stage in (1, 2, 3):
        checks.append(fp32_stage(stage, cfg, device, data, (start, ref_w, ref_norms), data_out))
    checks += bf16_stages(cfg, device, data, start, ref_w, data_out)
    return {"checks": checks, "data": data_out}


def fp32_stage(
    stage: int,
    cfg: GPTConfig,
    device: torch.device,
    data: list[Batch],
    ref: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]],
    out: dict[str, Any],
) -> dict[str, Any]:
    """fp32 ZeroStage{stage} after the clipped steps against AdamW's (see the tolerances below)."""
    start, ref_w, ref_norms = ref
    model = gpt(cfg, device, 0)
    opt = zero_stage(stage)(model, torch.optim.AdamW, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    norms = train(model, opt, data)
    got = weights(model, opt)
    same = all(torch.equal(got[k], ref_w[k]) for k in ref_w)
    rel, upd = max_rel(got, ref_w), update_rel(got, ref_w, start)
    same_norms = sum(a == b for a, b in zip(norms, ref_norms, strict=True))
    out[f"fp32_stage{stage}"] = {"bitwise": same, "max_rel": rel, "update_rel": upd, "norms": norms}
    seen = f"max rel {rel:.1e}, grad norm bitwise on {same_norms}/{len(data)} steps"
    if stage < 3:
        # Stages 1/2 at world size 1: the module's gradients copied into flat buckets (÷ 1), the global norm is
        # torch's (per-tensor norms, then the norm of those, in registration order), AdamW's element-wise update on
        # the flat masters (the reference's kernel: reference_adamw). Nothing is rounded differently: equal to the bit.
        detail = f"bitwise after {len(data)} clipped steps: {same}; update off by {upd:.1e}, {seen}"
        return check(f"fp32 ZeroStage{stage} = AdamW", same, detail)
    # Stage 3 buckets by unit (blocks, then the root's own parameters), so its norm of per-tensor norms sums in
    # another order: the total norm, hence the clip coefficient, may differ by rounding, at most n·u relative for n
    # tensors (u = 2^-24). AdamW is invariant to a common gradient scale up to its eps, so each element's update moves
    # by at most that plus its own ~4u of arithmetic; summed over the steps (to first order): the total update is off
    # by at most steps·(n + 4)·u.
    n = len(ref_w)
    tol = len(data) * (n + 4) * FP32_EPS
    detail = f"update off by {upd:.1e} <= {tol:.1e} = steps·(tensors + 4)·2^-24; bitwise: {same}; {seen}"
    return check("fp32 ZeroStage3 ≈ AdamW", upd <= tol, detail)


def bf16_stages(
    cfg: GPTConfig,
    device: torch.device,
    data: list[Batch],
    start: dict[str, torch.Tensor],
    ref_w: dict[str, torch.Tensor],
    out: dict[str, Any],
) -> list[dict[str, Any]]:
    """bf16 ZeroStage1/2/3 against AdamW on fp32 masters with ``torch.autocast(bf16)``, measured on the total update.

    The yardstick comes from this run: ``e_amp`` = how far autocast-bf16 AdamW's update is from the exact fp32
    update. A ZeRO stage under bf16 rounds where autocast does (weights and matmul outputs to bf16) and also keeps
    the residual stream and LayerNorm in bf16 (autocast keeps them fp32): at most about twice the rounding, so its
    distance from fp32 is at most ~2·e_amp and, by the triangle inequality, its distance from the autocast reference
    at most 3·e_amp. The check is meaningful while 3·e_amp < 1 (an engine that did not step scores 1)."""
    amp_model = gpt(cfg, device, 0)
    amp_opt = reference_adamw(amp_model.parameters())
    train(amp_model, amp_opt, data, lambda: torch.autocast(device.type, dtype=torch.bfloat16))
    amp_w = weights(amp_model)
    e_amp = update_rel(amp_w, ref_w, start)
    tol = 3 * e_amp
    out["bf16_autocast_vs_fp32_update_rel"] = e_amp
    checks = [check("bf16 autocast AdamW yardstick", 0 < tol < 1, f"update off fp32 by {e_amp:.3f}; tolerance 3x")]
    for stage in (1, 2, 3):
        model = gpt(cfg, device, 0)
        kwargs = {"lr": LR, "betas": BETAS, "weight_decay": WEIGHT_DECAY}
        opt = zero_stage(stage)(model, torch.optim.AdamW, precision="bf16", **kwargs)
        train(model, opt, data)
        rel = update_rel(weights(model, opt), amp_w, start)
        out[f"bf16_stage{stage}_vs_autocast_update_rel"] = rel
        detail = f"update off autocast AdamW by {rel:.3f} <= {tol:.3f} (3 x autocast's own bf16 error)"
        checks.append(check(f"bf16 ZeroStage{stage} ≈ autocast AdamW", rel <= tol, detail))
    return checks


# -- checkpoint --------------------------------------------------------------------------------------------------------
def checkpoint(device: torch.device, quick: bool) -> dict[str, Any]:
    """The async save's stall and a bit-exact resume, for stage 2 and stage 3 states on ``device``."""
    if device.type == "cuda" and not quick:
        cfg, size, seq = config_for("bench", **GPU_SIZES["gpt70m"], block_size=512), 8, 512
    else:
        cfg, size, seq = config_for("tiny" if quick else "small"), 4, 64
    checks, data = [], {}
    for stage in (2, 3):
        with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt") as tmp:
            c, d = checkpoint_stage(stage, cfg, size, seq, device, Path(tmp))
        checks += c
        data[f"stage{stage}"] = d
    return {"checks": checks, "data": data}


def checkpoint_stage(
    stage: int, cfg: GPTConfig, size: int, seq: int, device: torch.device, directory: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train, save twice asynchronously (fresh staging buffers, then reused ones) timing the stall and the steps
    taken while each writes, then load into a fresh model and optimizer and compare."""
    from elasticzero.checkpoint import Checkpointer, ZeroCheckpointState

    precision = "bf16"  # fp32 masters and state, bf16 compute copies: the module's copies are checked too
    model = gpt(cfg, device, 0)
    opt = zero_stage(stage)(model, torch.optim.AdamW, precision=precision, lr=1e-4, betas=BETAS)
    feed = itertools.cycle(batches(cfg, 8, size, seq, device))
    step = stepper(model, opt, feed)
    for _ in range(2):
        step()  # warm-up: kernels, allocator, optimizer state
    before = timed_steps(step, device, 5)
    ckpt = Checkpointer(directory, keep_last=2, async_save=True)
    saves, expected = [], None
    for n in (1, 2):
        save = timed_save(ckpt, 100 + n, {"model": ZeroCheckpointState(opt)}, device)
        if n == 2:  # what the second save holds: the state right now (nothing has stepped since)
            expected = (weights(model, opt), copy.deepcopy(opt.state_dict()))
        save["steps_while_writing_s"] = timed_steps(step, device, 3)
        t0 = time.perf_counter()
        ckpt.wait()
        save["commit_after_s"] = time.perf_counter() - t0
        saves.append(save)
    ckpt.close()
    step_s = statistics.median(before)
    data = {"precision": precision, "params": sum(p.numel() for p in model.parameters()), "step_s": step_s}
    data |= {"saves": saves, "stall_over_step": saves[-1]["stall_s"] / step_s}
    data["drag"] = statistics.median(saves[-1]["steps_while_writing_s"]) / step_s
    assert expected is not None
    return resume_checks(stage, cfg, device, directory, expected, precision, data), data


def stepper(model: torch.nn.Module, opt: torch.optim.Optimizer, feed: Iterator[Batch]) -> Callable[[], None]:
    from elasticzero.engine import optimizer_step

    def step() -> None:
        x, y = next(feed)
        lm_loss(model(x), y).backward()
        optimizer_step(opt, max_norm=1.0)

    return step


def timed_steps(step: Callable[[], None], device: torch.device, n: int) -> list[float]:
    """Seconds of each of ``n`` steps (device time between events on CUDA)."""
    clock = StepClock(device)
    for _ in range(n):
        clock.mark()
        step()
    clock.mark()
    return clock.intervals()


def timed_save(ckpt: Any, step: int, state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """How long ``save`` blocks the training thread, the device idle before it (a stall is host time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    ckpt.save(step, state)
    return {"step": step, "stall_s": time.perf_counter() - t0}


def resume_checks(
    stage: int,
    cfg: GPTConfig,
    device: torch.device,
    directory: Path,
    expected: tuple[dict[str, torch.Tensor], dict[str, Any]],
    precision: str,
    data: dict[str, Any],
) -> list[dict[str, Any]]:
    """Fresh model (other weights) and optimizer load the newest checkpoint: weights and optimizer state equal the
    saved ones to the bit, every parameter and master is on ``device``, and training goes on."""
    from elasticzero.checkpoint import Checkpointer, ZeroCheckpointState

    model = gpt(cfg, device, 1)
    opt = zero_stage(stage)(model, torch.optim.AdamW, precision=precision, lr=1e-4, betas=BETAS)
    t0 = time.perf_counter()
    with Checkpointer(directory) as ckpt:
        loaded = ckpt.load_latest({"model": ZeroCheckpointState(opt)})
    data["load_s"] = time.perf_counter() - t0
    want_w, want_opt = expected
    w_diff = first_difference(weights(model, opt), want_w, "masters")
    opt_diff = first_difference(opt.state_dict(), want_opt, "state_dict")
    masters = getattr(opt, "masters", [])
    on_device = all(t.device == device for t in [*model.parameters(), *masters])
    copies_diff, copies = None, "module holds freed views (stage 3)"
    if stage < 3:  # the module's compute copies, refreshed from the loaded masters
        module = {k: v for k, v in model.state_dict().items() if k in want_w}
        copies_diff = first_difference(module, {k: want_w[k].to(v.dtype) for k, v in module.items()}, "module")
        copies = copies_diff or "the module's compute copies ok"
    x, y = synthetic_batch(cfg, 2, 32, torch.Generator().manual_seed(7))
    loss = lm_loss(model(x.to(device)), y.to(device))
    loss.backward()
    loss = loss.detach()
    opt.step()
    opt.zero_grad()
    name = f"stage {stage} async save → resume"
    w_ok, w_detail = w_diff is None and copies_diff is None, f"{w_diff or 'masters ok'}; {copies}"
    stall = f"stall {1000 * data['saves'][-1]['stall_s']:.1f} ms = {data['stall_over_step']:.2f} step"
    return [
        check(f"{name}: step", loaded == 102, f"loaded step {loaded} (saved 101, 102); {stall}"),
        check(f"{name}: weights bit-exact", w_ok, w_detail),
        check(f"{name}: optimizer state bit-exact", opt_diff is None, opt_diff or "exp_avg, exp_avg_sq, step, groups"),
        check(f"{name}: on {device.type}", on_device, f"parameters and masters on {device}: {on_device}"),
        check(f"{name}: trains on", math.isfinite(float(loss)), f"loss after resume {float(loss):.4f}"),
    ]


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (tensors: device, dtype, shape, then bits; mappings, sequences, plain
    values), or None when they are equal to the bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        for what in ("device", "dtype", "shape"):
            if getattr(a, what) != getattr(b, what):
                return f"{path}: {what} {getattr(a, what)} != {getattr(b, what)}"
        return None if torch.equal(a, b) else f"{path}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        pairs = enumerate(zip(a, b, strict=True))
        return next((d for i, (x, y) in pairs if (d := first_difference(x, y, f"{path}[{i}]")) is not None), None)
    return None if type(a) is type(b) and a == b else f"{path}: {a!r} != {b!r}"


# -- live ------------------------------------------------------------------------------------------------------------
LIVE_STEPS = (2, 4)  # steps committed in round 0, then in all


def live(device: torch.device, quick: bool) -> dict[str, Any]:
    """``LiveTraining`` at world 1 on ``device`` through rounds 0 and 1 (one round file, this process its member):
    the group formed twice (NCCL on a GPU), every step committed once, the state the new optimizer (built afresh, other
    weights) starts round 1 from equal to the bit to the state round 0 ended with, on the device."""
    from elasticzero.live import LiveTraining
    from elasticzero.rounds import NodeRound, RoundFile, StoreAddress, write_round

    work = Path(tempfile.mkdtemp(prefix="gpu_check_live-"))
    path, store = str(work / "round.json"), StoreAddress("127.0.0.1", free_port(), True)
    write_round(path, NodeRound(0, 1, ((0, 0),), store, "live0/"))
    rounds = RoundFile(path)
    first = rounds.poll(-1)
    assert isinstance(first, NodeRound)
    cfg, built = config_for("tiny"), itertools.count()
    data = torch.cat([torch.cat(b, dim=1) for b in batches(cfg, 12, 1, 32, device)])  # 12 samples: input | target

    def build(group: Any) -> Any:
        return zero_stage(2)(gpt(cfg, device, seed=next(built)), torch.optim.AdamW, lr=LR, process_group=group)

    where = live_placement(device)
    if where.bound_device is not None:
        torch.cuda.set_device(torch.device(where.bound_device))
    job = LiveTraining(build, sampler=live_sampler(len(data)), rounds=rounds, first=first, local_rank=0, where=where)
    try:
        return live_rounds(job, data, path, store, device)
    finally:
        job.close()
        job.groups.abandon()  # NCCL: ProcessGroup.abort, then destroy
        shutil.rmtree(work, ignore_errors=True)


def live_placement(device: torch.device) -> Any:
    """The device rule of ``elasticzero.device`` over this section's facts (the device asked for, local rank 0)."""
    from elasticzero.device import Facts, placement

    cuda = device.type == "cuda"
    return placement(Facts(cuda, torch.cuda.device_count() if cuda else 0, {"LOCAL_RANK": "0"}))


def live_sampler(n: int) -> Any:
    from elasticzero.data.sampler import ElasticSampler

    return ElasticSampler(n, global_batch_size=2, micro_batch_size=1, rank=0, world_size=1, seed=0)


def live_rounds(job: Any, data: torch.Tensor, path: str, store: Any, device: torch.device) -> dict[str, Any]:
    """Train round 0, write round 1, train on; the checks."""
    from elasticzero.rounds import NodeRound, write_round

    env = environment(device)  # the first round's group is the default group now

    starts: list[tuple[int, dict[str, Any]]] = []  # (round, the optimizer's state) at the start of each attempt
    live_train(job, LIVE_STEPS[0], data, starts)
    ended = clone_state(job.opt)
    backend0, first_opt = dist.get_backend(), job.opt
    write_round(path, NodeRound(1, 1, ((0, 0),), store, "live1/"))
    job.bounded(lambda: None)  # between two steps: the round (the same member: a join's rule) is entered here
    live_train(job, LIVE_STEPS[1], data, starts)
    entered = next((st for r, st in starts if r == 1), None)
    diff = "no attempt in round 1" if entered is None else first_difference(entered, ended, "state")
    events = [(e.round.number, e.step) for e in job.events]
    steps = [s for s, _ in job.record]
    on_device = {str(p.device) for p in job.model.parameters()} == {str(device)}
    # gloo: the left group is cut once round 1 settled and let go after its first step; NCCL: aborted, kept
    kept = 0 if str(backend0) == "gloo" else 1
    return {
        "environment": env,
        "checks": [
            check(
                "live: round 0 -> round 1 in one process",
                events == [(1, LIVE_STEPS[0])] and len(job.groups.abandoned) == kept and job.opt is not first_opt,
                f"rounds entered at steps {events} (want [(1, {LIVE_STEPS[0]})]); groups left and kept "
                f"{len(job.groups.abandoned)} (want {kept}); backend {backend0} then {dist.get_backend()}",
            ),
            check(
                "live: state carried bitwise into the new optimizer",
                diff is None,
                diff or "masters and AdamW moments/steps equal to the bit, on the device",
            ),
            check(
                "live: every step committed once, the model on the device",
                steps == list(range(LIVE_STEPS[1])) and on_device,
                f"committed steps {steps}; parameters on {sorted({str(p.device) for p in job.model.parameters()})}",
            ),
        ],
        "data": {
            "events": events,
            "seconds_to_first_step": [e.first_step_at - e.left_at for e in job.events if e.first_step_at is not None],
            "copies": "none: one rank is one node (copies and transfers between ranks need two GPUs)",
        },
    }


def live_train(job: Any, total: int, data: torch.Tensor, starts: list[tuple[int, dict[str, Any]]]) -> None:
    """The user's loop: one ``with attempt`` per step."""
    half = data.shape[1] // 2
    for attempt in job.steps(total):
        with attempt:
            starts.append((job.round.number, clone_state(attempt.opt)))
            for idx in attempt.micro_batches:
                batch = data[idx]
                lm_loss(attempt.model(batch[:, :half]), batch[:, half:]).backward()
            attempt.opt.step()
            attempt.opt.zero_grad()


def clone_state(opt: Any) -> dict[str, Any]:
    """The optimizer's fp32 masters and wrapped-optimizer state, cloned (tensors stay on their device)."""
    inner = copy.deepcopy(opt.optim.state_dict())
    return {"masters": [m.detach().clone() for m in opt.masters], "optim": inner}


# -- offload ----------------------------------------------------------------------------------------------------------
def offload(device: torch.device, quick: bool) -> dict[str, Any]:
    """ZeRO-Offload at world size 1: ZeroStage1/2/3 with the optimizer offloaded (stage 3 its parameters too) train
    like the same stage without offload (fp32; the ez_numerics rule, a float64 run of the same GPT being the truth)
    with the step taken in backward; the masters, the optimizer state and the gradient shards are in host memory,
    page-locked, the copies on a stream of their own; the offloaded run's peak device memory is below the resident
    one's. On the CPU (a check of this code) the host path runs with ``cpu_copies`` (no pinning, no stream)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return _offload(device, quick)


def _offload(device: torch.device, quick: bool) -> dict[str, Any]:
    from elasticzero.engine.zero.offload import OffloadOptions
    from ez_numerics import error_ratio

    cfg = config_for("tiny" if quick else "small", block_size=64)
    data = batches(cfg, 2 if quick else 4, 4, 64, device)
    truth = offload_truth(cfg, device, data)
    checks, out = [], {}
    for stage in (1, 2, 3):
        options = OffloadOptions(optimizer=True, params=stage == 3, cpu_copies=device.type == "cpu")
        runs = {}
        for name, opts in (("offloaded", options), ("resident", None)):
            model = gpt(cfg, device, 0)
            opt = zero_stage(stage)(
                model, torch.optim.AdamW, offload=opts, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY
            )
            out[f"stage{stage}_{name}"] = offload_train(model, opt, data, device)
            runs[name] = weights(model, opt)
            if opts is not None:
                checks += placement_checks(stage, model, opt, data[0], device)
        ratio = error_ratio(runs["offloaded"], runs["resident"], truth)
        out[f"stage{stage}_error_ratio"] = ratio
        detail = f"error ratio {ratio:.2f} <= 1 (ez_numerics: 3x the resident run's own fp32 rounding vs float64)"
        checks.append(check(f"fp32 ZeroStage{stage} offloaded = resident", ratio <= 1.0, detail))
    if device.type == "cuda":
        checks.append(memory_check(out))
    return {"checks": checks, "data": out}


def offload_truth(cfg: GPTConfig, device: torch.device, data: list[Batch]) -> dict[str, torch.Tensor]:
    """The same training in float64 (plain AdamW, torch's single-tensor implementation)."""
    model = gpt(cfg, device, 0).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=False)
    for x, y in data:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().double() for k, v in model.state_dict().items()}


def offload_train(model: torch.nn.Module, opt: Any, data: list[Batch], device: torch.device) -> dict[str, Any]:
    """One step per batch, the backward inside ``opt.stepping_in_backward()`` (no clip: the step runs in backward);
    the peak device memory and whether an offloaded bucket stepped during a backward."""
    from elasticzero.engine import optimizer_step

    stepped_in_backward = False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for x, y in data:
        with opt.stepping_in_backward():
            lm_loss(model(x), y).backward()
        offloader = getattr(opt, "_offload", None)
        stepped_in_backward |= bool(offloader is not None and offloader._steps.stepped)
        optimizer_step(opt)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"peak_device_bytes": peak, "stepped_in_backward": stepped_in_backward}


def placement_checks(stage: int, model: torch.nn.Module, opt: Any, batch: Batch, device: torch.device) -> list[Any]:
    """Where the offloaded state is: masters, optimizer state and (after a backward) gradient shards in host memory,
    page-locked on CUDA (the state itself never crosses the bus: it need not be); the copy stream on CUDA."""
    cuda = device.type == "cuda"
    masters = list(opt.masters)
    state = [t for m in masters for t in opt.optim.state[m].values() if torch.is_tensor(t) and t.dim() == 1]
    lm_loss(model(batch[0]), batch[1]).backward()
    grads = [m.grad for m in masters if m.grad is not None]
    opt.zero_grad()
    on_host = all(t.device.type == "cpu" for t in (*masters, *state, *grads)) and bool(grads) and bool(state)
    pinned = all(t.is_pinned() == cuda for t in (*masters, *grads))
    stream = opt._offload.copier.stream
    side = stream is not None and stream != torch.cuda.current_stream(device) if cuda else stream is None
    detail = f"{len(masters)} masters, {len(state)} state tensors, {len(grads)} gradient shards on the host"
    return [
        check(f"ZeroStage{stage} offloaded state in host memory", on_host, detail),
        check(f"ZeroStage{stage} host buffers page-locked", pinned, "pinned" if cuda else "the CPU: none needed"),
        check(f"ZeroStage{stage} copies on a side stream", side, "a stream of its own" if cuda else "none on the CPU"),
    ]


def memory_check(out: dict[str, Any]) -> dict[str, Any]:
    """On the GPU: each stage's offloaded peak device memory below its resident one, and the early step ran."""
    lines, ok = [], True
    for stage in (1, 2, 3):
        got, ref = (out[f"stage{stage}_{k}"] for k in ("offloaded", "resident"))
        ok &= got["peak_device_bytes"] < ref["peak_device_bytes"] and got["stepped_in_backward"]
        lines.append(
            f"stage{stage} {got['peak_device_bytes'] / 2**20:.1f} vs {ref['peak_device_bytes'] / 2**20:.1f} MiB"
        )
    return check("offloaded peak device memory < resident; step in backward", ok, "; ".join(lines))


SECTIONS: dict[str, Callable[[torch.device, bool], dict[str, Any]]] = {
    "correctness": correctness,
    "checkpoint": checkpoint,
    "live": live,
    "offload": offload,
}
OWN_WORLD = {"live"}  # sections that form their process groups themselves


CPU = torch.device("cpu")


def in_world_of_one(section: str, kind: str, quick: bool) -> dict[str, Any]:
    """``section`` in a world of one opened for it (:func:`open_world`), destroyed after."""
    device = open_world(kind)
    try:
        return {"environment": environment(device), **SECTIONS[section](device, quick)}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=sorted(SECTIONS))
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    result: dict[str, Any]
    try:
        if args.section in OWN_WORLD:
            result = SECTIONS[args.section](torch.device("cuda", 0) if args.device == "cuda" else CPU, args.quick)
        else:
            result = in_world_of_one(args.section, args.device, args.quick)
    except Exception as exc:  # the driver prints it as this section's FAIL line; the traceback goes to the log
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
