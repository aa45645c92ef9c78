"""Worker side of the ZeRO multi-process tests: run scenarios on real gloo ranks, report metrics to the parent.

Each rank computes the single-process reference itself (plain ``torch.optim.AdamW`` on the whole global batch), in
fp32 and in float64 (the truth), and compares the ZeRO run on that rank (its own module and compute copies) with them:
an fp32 run may be off the truth by what rounding moved the fp32 reference on this machine
(``ez_numerics.error_ratio``, reported as ``*_ratio``); every rank writes ``{scenario: metrics}`` as JSON
(``<path>.rank<r>``) and the test asserts on all of them.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import json
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import elasticzero
import elasticzero.errors
from elasticzero.engine.precision import PrecisionPolicy
from ez_numerics import error_ratio

VOCAB, DIM, HID, SEQ, GLOBAL_BATCH = 11, 7, 13, 5, 6
LR, WD, STEPS, ACCUM, MAX_NORM = 1e-2, 0.1, 10, 2, 0.5
BUCKET_BYTES = 256  # tiny: forces several buckets, some params alone, params split across ranks


class Tiny(nn.Module):
    """Uneven sizes, a tied weight (emb/head), a frozen layer and a 1-element parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HID)
        self.frozen = nn.Linear(HID, HID)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(1))
        self.fc2 = nn.Linear(HID, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(self.emb(idx)))
        x = torch.tanh(self.frozen(x) * self.gain)
        return self.head(self.fc2(x))


class Blocks(nn.Module):
    """A GPT-shaped model: tied embedding/head around an ``nn.ModuleList`` of blocks (stage 3's default units)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

        self.checkpoint = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = x + (checkpoint(b, x, use_reentrant=False) if self.checkpoint else b(x))
        return self.head(x)


class MaybeB(nn.Module):
    """A block whose second linear layer is used only when ``use_b`` (set per rank: unused on some ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        return y + self.b(x) if self.use_b else y


class Unused(nn.Module):
    """Three stage-3 units (blocks) between an embedding and a head; ``blocks[1].b`` is used on some ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MaybeB() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _use_b(model: Unused, used: bool) -> None:
    block = model.blocks[1]
    assert isinstance(block, MaybeB)
    block.use_b = used


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only, and a different lr for the vectors (torch's usual two groups)."""
    mats = [p for p in trainable(model) if p.dim() >= 2]
    vecs = [p for p in trainable(model) if p.dim() < 2]
    return [{"params": mats}, {"params": vecs, "weight_decay": 0.0, "lr": 2 * LR}]


def make_model(kind: str = "tiny") -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("blocks"):
        model = Blocks()
        model.checkpoint = kind == "blocks_ckpt"
        return model
    return Tiny()


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return x, y


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In fp32 from low-precision logits, in float64 for the float64 truth."""
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, VOCAB), y.reshape(-1)
    )


def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


@functools.lru_cache(maxsize=16)
def reference(
    accum: int = ACCUM,
    clip: float | None = MAX_NORM,
    kind: str = "tiny",
    grouped: bool = False,
    dtype: torch.dtype = torch.float32,
    compute: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """AdamW on the global batches in ``dtype``; with ``compute`` (bf16, fp16) forward and backward run on per-rank
    copies in that dtype (:func:`_low_precision_grads`), where a low-precision ZeRO run rounds."""
    model = make_model(kind).to(dtype)
    opt = torch.optim.AdamW(groups(model) if grouped else trainable(model), lr=LR, weight_decay=WD)
    sch = sched(opt)
    norms = []
    for step in range(STEPS):
        if compute is not None:
            _low_precision_grads(model, step, accum, compute)
        for m in range(accum if compute is None else 0):
            x, y = batch(step, m)
            (loss_fn(model(x), y) / accum).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sch.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _low_precision_grads(model: nn.Module, step: int, accum: int, compute: torch.dtype) -> None:
    """Each rank's slice on its own ``compute`` copy of ``model``, accumulated there over the micro-batches (as a
    rank's module does), then averaged over the ranks in fp32 into the fp32 model's gradients."""
    rank_count = dist.get_world_size()
    per = GLOBAL_BATCH // rank_count
    works = [copy.deepcopy(model).to(compute) for _ in range(rank_count)]
    for m in range(accum):
        x, y = batch(step, m)
        for r, work in enumerate(works):
            (loss_fn(work(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per]) / accum).backward()
    for p, *qs in zip(model.parameters(), *(w.parameters() for w in works), strict=True):
        grads = [q.grad.float() for q in qs if q.grad is not None]
        if grads:
            p.grad = sum(grads[1:], grads[0]) / rank_count


def zero_run(
    stage: int,
    precision: str | PrecisionPolicy = "fp32",
    accum: int = ACCUM,
    clip: float | None = MAX_NORM,
    no_sync: bool = False,
    kind: str = "tiny",
    grouped: bool = False,
    set_to_none: bool = True,
    validate: bool = False,
    **kw: Any,
) -> tuple[Any, dict[str, torch.Tensor], list[float]]:
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    model = make_model(kind)
    if grouped:
        kw["param_groups"] = groups(model)
    if kw.get("units") == "first_block":
        kw["units"] = model.get_submodule("blocks.0")  # a single module instance
    opt = cls(model, torch.optim.AdamW, lr=LR, weight_decay=WD, precision=precision, bucket_bytes=BUCKET_BYTES, **kw)
    sch = sched(opt)
    norms = train(model, opt, sch, range(STEPS), accum, clip, no_sync, set_to_none, validate)
    return opt, opt.full_state_dict(), norms


def train(
    model: nn.Module,
    opt: Any,
    sch: Any,
    steps: range,
    accum: int = ACCUM,
    clip: float | None = MAX_NORM,
    no_sync: bool = False,
    set_to_none: bool = True,
    validate: bool = False,
) -> list[float]:
    """The user's plain loop on this rank's slice of every global micro-batch.

    ``validate``: after backward, a ``torch.no_grad()`` forward before ``step()`` (a validation pass); on stage 3 it
    must leave no unit gathered (``VALIDATION_LEFT_GATHERED`` counts the times it did).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    norms = []
    for step in steps:
        for m in range(accum):
            x, y = batch(step, m)
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            ctx = opt.no_sync() if (no_sync and m < accum - 1) else _null()
            with ctx:
                (loss_fn(model(x), y) / accum).backward()
        if validate:
            with torch.no_grad():
                model(x)
            if getattr(opt, "stage", 0) == 3 and any(p.untyped_storage().nbytes() for p in opt._managed_params()):
                VALIDATION_LEFT_GATHERED.append(step)
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        sch.step()
        opt.zero_grad(set_to_none=set_to_none)
    return norms


VALIDATION_LEFT_GATHERED: list[int] = []


def resume_run(stage: int) -> dict[str, torch.Tensor]:
    """Train half the steps, checkpoint (full model state, optimizer shard state, scheduler), rebuild, finish."""
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    model = make_model()
    opt = cls(model, torch.optim.AdamW, lr=LR, weight_decay=WD, bucket_bytes=BUCKET_BYTES)
    sch = sched(opt)
    train(model, opt, sch, range(STEPS // 2))
    ckpt = copy.deepcopy({"model": opt.full_state_dict(), "optim": opt.state_dict(), "sched": sch.state_dict()})
    torch.manual_seed(123)
    model = Tiny()  # different initial weights: everything must come from the checkpoint
    opt = cls(model, torch.optim.AdamW, lr=LR, weight_decay=WD, bucket_bytes=BUCKET_BYTES)
    sch = sched(opt)
    opt.load_full_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    sch.load_state_dict(ckpt["sched"])
    train(model, opt, sch, range(STEPS // 2, STEPS))
    return opt.full_state_dict()


class PhaseRecorder:
    """Stands in for ``PhaseTimers``: records the phase names it is asked to time."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.seen.add(name)
        yield


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b||_inf / ||b||_inf."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()) for k in b)


def ratio(full: dict[str, torch.Tensor], kind: str = "tiny", grouped: bool = False) -> float:
    """``full`` against the fp32 reference and the float64 truth of the same training (``ez_numerics``)."""
    ref, truth = (reference(kind=kind, grouped=grouped, dtype=d)[0] for d in (torch.float32, torch.float64))
    return error_ratio(full, ref, truth)


def scenario_equality(stage: int, out: dict[str, Any]) -> None:
    ref, ref_norms = reference()
    opt, full, norms = zero_run(stage)
    out[f"s{stage}_fp32_ratio"] = ratio(full)
    out[f"s{stage}_norm_ratio"] = error_ratio(norms, ref_norms, reference(dtype=torch.float64)[1])
    out[f"s{stage}_clipped_steps"] = sum(n > MAX_NORM for n in ref_norms)
    out[f"s{stage}_lr_final"] = opt.param_groups[0]["lr"]
    if stage < 3:
        module_sd = {k: v.detach().clone() for k, v in opt.module.state_dict().items()}
        out[f"s{stage}_module_sd_ratio"] = ratio(module_sd)
    if stage < 3:
        _, full_ns, _ = zero_run(stage, no_sync=True)
        out[f"s{stage}_nosync_ratio"] = ratio(full_ns)
    if stage == 3:
        _, full_u, _ = zero_run(stage, units=nn.Linear, prefetch=False, reshard_after_forward=False)
        out["s3_units_ratio"] = ratio(full_u)
        _, full_p, _ = zero_run(
            stage, units=lambda m: isinstance(m, nn.Linear) and m.bias is not None, prefetch_bytes=1
        )
        out["s3_units_pred_ratio"] = ratio(full_p)
        opt_b, full_b, _ = zero_run(stage, kind="blocks")
        out["s3_blocks_ratio"] = ratio(full_b, kind="blocks")
        out["s3_blocks_units"] = sorted(set(opt_b.unit_of_bucket().values()))
        opt_i, full_i, _ = zero_run(stage, kind="blocks", units="first_block")
        out["s3_instance_ratio"] = ratio(full_i, kind="blocks")
        out["s3_instance_units"] = sorted(set(opt_i.unit_of_bucket().values()))
        _, full_c, _ = zero_run(stage, kind="blocks_ckpt")
        out["s3_ckpt_ratio"] = ratio(full_c, kind="blocks")
        VALIDATION_LEFT_GATHERED.clear()
        _, full_v, _ = zero_run(stage, reshard_after_forward=False, validate=True)
        out["s3_validate_ratio"] = ratio(full_v)
        out["s3_validate_left_gathered"] = len(VALIDATION_LEFT_GATHERED)
    _, full_z, _ = zero_run(stage, set_to_none=False)
    out[f"s{stage}_zero_grad_keep_ratio"] = ratio(full_z)
    out[f"s{stage}_resume_ratio"] = ratio(resume_run(stage))
    _, full_g, _ = zero_run(stage, grouped=True)
    out[f"s{stage}_groups_ratio"] = ratio(full_g, grouped=True)
    low_reduce = PrecisionPolicy.from_name("bf16", reduce_in_low_precision=True)
    for key, prec, compute in (
        ("bf16", "bf16", torch.bfloat16),
        ("fp16", "fp16", torch.float16),
        ("bf16_lowreduce", low_reduce, torch.bfloat16),
    ):
        _, full_lp, _ = zero_run(stage, precision=prec)
        out[f"s{stage}_{key}_rel"] = max_rel(full_lp, ref)  # > 0: the precision was applied
        low_ref, truth = reference(compute=compute)[0], reference(dtype=torch.float64)[0]
        out[f"s{stage}_{key}_ratio"] = error_ratio(full_lp, low_ref, truth)


def scenario_comm_memory(stage: int, out: dict[str, Any]) -> None:
    """One clean step (no accumulation, no clipping): count elements; then the memory report."""
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    model = make_model()
    timers = PhaseRecorder()
    opt = cls(model, torch.optim.AdamW, lr=LR, precision="fp32", bucket_bytes=BUCKET_BYTES, timers=timers)
    x, y = batch(0, 0)
    for _ in range(2):  # second step measured (stage 3 records its order on the first)
        opt.comm_stats.reset()
        loss_fn(model(x[:2]), y[:2]).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    out[f"s{stage}_phases"] = sorted(timers.seen)
    padded = sum(b.padded_numel for b in opt.buckets)
    out[f"s{stage}_psi"] = opt.numel
    out[f"s{stage}_padded"] = padded
    out[f"s{stage}_nbuckets"] = len(opt.buckets)
    out[f"s{stage}_comm_elems"] = opt.comm_stats.total_elements()
    other = [n for (_, tag), n in opt.comm_stats.elements.items() if tag not in ("grad", "param")]
    out[f"s{stage}_comm_other"] = sum(other)
    out[f"s{stage}_memory"] = opt.memory_report()
    if stage == 3:
        out["s3_params_freed"] = all(p.untyped_storage().nbytes() == 0 for p in opt._managed_params())
        try:
            opt.no_sync()
            out["s3_no_sync_raises"] = False
        except elasticzero.errors.UsageError:
            out["s3_no_sync_raises"] = True
        m2 = make_model()
        o2 = elasticzero.ZeroStage3(
            m2, torch.optim.AdamW, lr=LR, bucket_bytes=BUCKET_BYTES, reshard_after_forward=False
        )
        for _ in range(2):
            o2.comm_stats.reset()
            loss_fn(m2(x[:2]), y[:2]).backward()
            o2.step()
            o2.zero_grad()
        out["s3_no_reshard_comm_elems"] = o2.comm_stats.total_elements()
    # loss-scaler protocol: unscale_ scales in place; an inf in one rank's shard makes every rank skip the step
    loss_fn(model(x[:2]), y[:2]).backward()
    before = [g.clone() for g in opt.grad_shards()]
    found = opt.unscale_(0.5)
    out[f"s{stage}_unscale_ok"] = float(found) == 0.0 and all(
        torch.allclose(g, b * 0.5) for g, b in zip(opt.grad_shards(), before, strict=True)
    )
    scaler = elasticzero.LossScaler(2.0**4, hysteresis=1)
    if dist.get_rank() == 0:
        opt.grad_shards()[0].view(-1)[0] = float("inf")  # this rank's shard only
    params_before = opt.full_state_dict()
    scaler.step(opt)
    scaler.update()
    out[f"s{stage}_scaler_skipped"] = scaler.skipped_steps
    out[f"s{stage}_scaler_scale"] = scaler.get_scale()
    out[f"s{stage}_scaler_params_kept"] = max_rel(opt.full_state_dict(), params_before) == 0.0
    opt.zero_grad()


def scenario_module_state_dict(stage: int, out: dict[str, Any]) -> None:
    """``module.state_dict()``/``load_state_dict()``: stage 3 refuses them; bf16 stages 1/2 keep what was loaded."""
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    model = make_model()
    opt = cls(model, torch.optim.AdamW, lr=LR, precision="bf16", bucket_bytes=BUCKET_BYTES)
    x, y = batch(0, 0)
    loss_fn(model(x[:2]), y[:2]).backward()
    opt.step()
    opt.zero_grad()
    torch.manual_seed(7)
    target = {k: v.to(torch.bfloat16) for k, v in Tiny().state_dict().items()}
    if stage == 3:
        for name, call in (("sd", model.state_dict), ("load", lambda: model.load_state_dict(target))):
            try:
                call()
                out[f"s3_module_{name}_error"] = ""
            except elasticzero.errors.UsageError as e:
                out[f"s3_module_{name}_error"] = str(e)
        return
    model.load_state_dict(target)
    opt.step()  # no gradients: AdamW leaves the masters alone, then they are all-gathered over the module
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out[f"s{stage}_bf16_load_rel"] = max_rel(loaded, target)
    out[f"s{stage}_bf16_load_full_rel"] = max_rel(opt.full_state_dict(), target)


def scenario_frozen_group(stage: int, out: dict[str, Any]) -> None:
    """A param group holding only frozen parameters keeps its index (per-group schedulers)."""
    cls = getattr(elasticzero, f"ZeroStage{stage}")
    model = make_model()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    pgs = [{"params": frozen, "lr": 0.5}, {"params": trainable(model), "lr": LR}]
    opt = cls(model, torch.optim.AdamW, param_groups=pgs, lr=LR, bucket_bytes=BUCKET_BYTES)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5**e])
    x, y = batch(0, 0)
    loss_fn(model(x[:2]), y[:2]).backward()
    opt.step()
    sch.step()
    out[f"s{stage}_frozen_group_sizes"] = [len(g["params"]) for g in opt.param_groups]
    out[f"s{stage}_frozen_group_lrs"] = [g["lr"] for g in opt.param_groups]


def scenario_unused_param(out: dict[str, Any]) -> None:
    """Stage 3 with ``blocks[1].b`` used on rank 0 only (its gradient is zero elsewhere), no prefetch: finishes
    (same collective order on every rank) and equals AdamW on the mean of the per-rank losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    torch.manual_seed(0)
    model = Unused()
    opt = elasticzero.ZeroStage3(
        model, torch.optim.AdamW, lr=LR, weight_decay=WD, bucket_bytes=BUCKET_BYTES, prefetch=False
    )
    for step in range(3):
        x, y = batch(step, 0)
        _use_b(model, rank == 0)
        loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    ref, truth = (unused_reference(world, d) for d in (torch.float32, torch.float64))
    out["s3_unused_ratio"] = error_ratio(opt.full_state_dict(), ref, truth)


def unused_reference(world: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """AdamW (in ``dtype``) on the mean of the ranks' losses, ``blocks[1].b`` used by rank 0's slice only."""
    per = GLOBAL_BATCH // world
    torch.manual_seed(0)
    ref = Unused().to(dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(3):
        x, y = batch(step, 0)
        for r in range(world):
            _use_b(ref, r == 0)
            (loss_fn(ref(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per]) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {k: v.detach() for k, v in ref.state_dict().items()}


def scenario_bucketer(out: dict[str, Any]) -> None:
    """GradBucketer on its own, DDP-style all-reduce: p.grad is the global-batch gradient after backward."""
    from elasticzero import GradBucketer

    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    ref, truth = (bucketer_reference(d) for d in (torch.float32, torch.float64))
    model = make_model()
    bucketer = GradBucketer(model.named_parameters(), op="all_reduce", bucket_bytes=BUCKET_BYTES)
    for m in range(2):  # accumulation across two synced backwards
        x, y = batch(0, m)
        loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
    out["bucketer_nbuckets"] = len(bucketer.buckets)
    got = {n: torch.as_tensor(p.grad) for n, p in model.named_parameters() if n in truth}  # None: as_tensor raises
    out["bucketer_ratio"] = error_ratio(got, ref, truth)
    out["bucketer_order"] = bucketer.flush_order


def bucketer_reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The gradients (in ``dtype``) of two global micro-batches on one process."""
    ref = make_model().to(dtype)
    for m in range(2):
        x, y = batch(0, m)
        loss_fn(ref(x), y).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


SCENARIOS: dict[str, Callable[[dict[str, Any]], None]] = {}


def worker(rank: int, world: int, port: int, result_path: str, stages: list[int]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    out: dict[str, Any] = {}
    try:
        for stage in stages:
            scenario_equality(stage, out)
            scenario_comm_memory(stage, out)
            scenario_module_state_dict(stage, out)
            scenario_frozen_group(stage, out)
        if 3 in stages:
            scenario_unused_param(out)
        scenario_bucketer(out)
        dist.barrier()
    except Exception:
        out["error"] = traceback.format_exc()
        raise
    finally:
        with open(f"{result_path}.rank{rank}", "w") as f:
            json.dump(out, f, default=str)
        dist.destroy_process_group()
