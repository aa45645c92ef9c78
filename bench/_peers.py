"""The benchmark's peers: one training setup each, behind one small interface (forward+backward, step, zero_grad).

Every peer trains the same GPT (same seed, same batch) with ``torch.optim.AdamW`` at the same hyper-parameters.
Imports of optional stacks (elasticzero, DeepSpeed) happen inside the builders, after the collective counter is
installed, so their calls are counted.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from _measure import ddp_counting_hook

PEERS = (
    "ddp",
    "torch_zero1",
    "fsdp2",
    "fsdp2_keep",
    "ez_stage1",
    "ez_stage2",
    "ez_stage3",
    "ds_stage1",
    "ds_stage2",
    "ds_stage3",
    "fsdp2_compiled",
    "ez_stage1_compiled",
    "ez_stage2_compiled",
    "ez_stage3_compiled",
)
"""Run order. ``torch_zero1`` = DDP + ``ZeroRedundancyOptimizer``; ``fsdp2`` = ``fully_shard`` with
``reshard_after_forward=True``, ``fsdp2_keep`` with ``False``; ``ez_stageN`` = elasticzero ``ZeroStageN``;
``ds_stageN`` = DeepSpeed ZeRO stage N on CPU; ``<peer>_compiled`` = that peer with every transformer block compiled
(``block.compile()`` after wrapping, torchtitan's per-block pattern; Inductor compiles in the warm-up steps)."""
COMPILED_SUFFIX = "_compiled"
OFFLOAD_PEERS = ("fsdp2_offload", "ez_stage2_offload", "ez_stage3_offload", "ez_stage3_offload_opt")
"""The offload peers (``engine_bench.py --largest``, GPU only): ``fsdp2_offload`` = ``fully_shard`` with
``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the optimizer step on the host);
``ez_stage3_offload`` = ``ZeroStage3`` with optimizer and parameter offload (the same split); ``_opt``: optimizer
offload only (a compute-dtype copy of the shards stays on the device); ``ez_stage2_offload``: ``ZeroStage2`` with
optimizer offload. The elasticzero ones step each bucket on the host as its gradient lands (no clipping here)."""
ALL_PEERS = ("adamw", *PEERS, *OFFLOAD_PEERS)
"""``adamw`` (plain ``torch.optim.AdamW`` on the bare model, no wrapper, no collective: the single-device baseline
``bench/gpu_check.py`` divides by) is not in the default run."""

GPU_SIZES: dict[str, dict[str, int]] = {
    "gpt350m": {"vocab_size": 32768, "n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt70m": {"vocab_size": 8192, "n_layer": 8, "n_head": 8, "n_embd": 768},
    "gpt1b": {"vocab_size": 32768, "n_layer": 24, "n_head": 16, "n_embd": 2048},
    "gpt2b": {"vocab_size": 32768, "n_layer": 32, "n_head": 20, "n_embd": 2560},
    "gpt4b": {"vocab_size": 32768, "n_layer": 32, "n_head": 24, "n_embd": 3072},
    "gpt7b": {"vocab_size": 32768, "n_layer": 32, "n_head": 32, "n_embd": 4096},
    "gpt10b": {"vocab_size": 32768, "n_layer": 40, "n_head": 40, "n_embd": 4608},
    "gpt13b": {"vocab_size": 32768, "n_layer": 40, "n_head": 40, "n_embd": 5120},
}
"""GPT shapes for one GPU, over ``examples/gpt.py``'s ``bench`` size: ~70M, ~370M, then ~1.3B to ~13B parameters at
block 1024 (``SEARCH_SIZES``: the largest-model search's ladder)."""
SEARCH_SIZES = ("gpt350m", "gpt1b", "gpt2b", "gpt4b", "gpt7b", "gpt10b", "gpt13b")

# bytes per parameter per rank held by fp32 AdamW training per the ZeRO paper (N ranks): params, grads, 2 states
FORMULA: dict[str, Callable[[int], float]] = {
    "adamw": lambda n: 16.0,
    "ddp": lambda n: 16.0,
    "torch_zero1": lambda n: 4 + 4 + 8 / n,
    "fsdp2": lambda n: 16 / n,
    "fsdp2_keep": lambda n: 16 / n,
    "ez_stage1": lambda n: 4 + 4 + 8 / n,
    "ez_stage2": lambda n: 4 + (4 + 8) / n,
    "ez_stage3": lambda n: 16 / n,
    "ds_stage1": lambda n: 4 + 4 + 8 / n,
    "ds_stage2": lambda n: 4 + (4 + 8) / n,
    "ds_stage3": lambda n: 16 / n,
}
FORMULA |= {p: FORMULA[p.removesuffix(COMPILED_SUFFIX)] for p in PEERS if p.endswith(COMPILED_SUFFIX)}
# offloaded: the same bytes, held in host and device memory together
FORMULA |= {p: FORMULA[p.split("_offload")[0]] for p in OFFLOAD_PEERS}
# communication per rank per step in units of Ψ, as the ZeRO paper counts it (all-reduce = 2Ψ)
COMM_GOAL = {
    "adamw": 0,
    "ddp": 2,
    "torch_zero1": 3,
    "fsdp2": 3,
    "fsdp2_keep": 2,
    "ez_stage1": 2,
    "ez_stage2": 2,
    "ez_stage3": 3,
    "ds_stage1": 2,
    "ds_stage2": 2,
    "ds_stage3": 3,
}
COMM_GOAL |= {p: COMM_GOAL[p.removesuffix(COMPILED_SUFFIX)] for p in PEERS if p.endswith(COMPILED_SUFFIX)}
COMM_GOAL |= {"fsdp2_offload": 3, "ez_stage2_offload": 2, "ez_stage3_offload": 3, "ez_stage3_offload_opt": 3}


def host_threads(peer: str, world: int, cpus: int | None) -> int:
    """Intra-op threads of a rank: 1 (the engines' own CPU work is small; ranks share the machine), but an offload
    peer's optimizer step runs on the host, so it gets its share of the cores."""
    return max(1, (cpus or 1) // max(1, world)) if peer in OFFLOAD_PEERS else 1


@dataclass
class Peer:
    """A built training setup: ``net`` is what is called on the batch; ``step``/``zero_grad`` drive the optimizer."""

    net: nn.Module
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    backward: Callable[[torch.Tensor], None] = field(default=lambda loss: loss.backward())
    engine_comm: Callable[[], dict[str, int]] | None = None
    """The engine's own collective counter (elements by op), when it has one."""
    memory_report: Callable[[], dict[str, float]] | None = None
    """The engine's own held-memory report (bytes by category), when it has one."""
    info: dict[str, Any] = field(default_factory=dict)
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    """The context the forward (and loss) runs in: ``torch.autocast`` for the peers that keep fp32 parameters under
    a low-precision run (``adamw``, ``ddp``, ``torch_zero1``); the others cast their parameters themselves."""


@dataclass(frozen=True)
class Setting:
    """Where and how every peer of a run trains: device (``cpu``: gloo; ``cuda``: NCCL), precision (``fp32``, or
    ``bf16``: autocast for fp32-parameter peers, FSDP2's ``MixedPrecisionPolicy``, ZeRO's policy) and the AdamW
    implementation every peer gets (``fused``: ``fused=True``, torch's fastest on either device, so step times compare
    the engines and not their optimizer kernels; ``default``: the caller passes none, so plain peers get torch's
    default — a loop of single-tensor ops on the CPU — and the ZeRO stages their own fused default)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    adamw: str = "fused"

    @property
    def low(self) -> torch.dtype | None:
        """The compute dtype of a low-precision run, else None."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """The forward context of a peer with fp32 parameters."""
        low, kind = self.low, self.device.type
        return contextlib.nullcontext if low is None else lambda: torch.autocast(kind, dtype=low)

    def ddp_kwargs(self) -> dict[str, Any]:
        return {"device_ids": [self.device]} if self.device.type == "cuda" else {}


CPU = Setting()


def _adamw_kwargs(lr: float, setting: Setting = CPU) -> dict[str, Any]:
    fused = {"fused": True} if setting.adamw == "fused" else {}
    return {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.0, **fused}


def build_adamw(model: nn.Module, lr: float, setting: Setting) -> Peer:
    """``torch.optim.AdamW`` on the bare model (fused unless ``setting.adamw`` says otherwise): no wrapper, no
    collective."""
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(lr, setting))
    return Peer(model, opt.step, lambda: opt.zero_grad(set_to_none=True), autocast=setting.autocast())


def build_ddp(model: nn.Module, lr: float, bucket_mb: float, setting: Setting = CPU) -> Peer:
    """DDP (gradient buckets as grad views) + AdamW; on CPU a counting comm hook equal to torch's default all-reduce
    (on CUDA DDP's own reducer: nothing counts NCCL traffic here, and the hook would add Python work per bucket)."""
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **setting.ddp_kwargs()
    )
    if setting.device.type == "cpu":
        ddp.register_comm_hook(None, ddp_counting_hook)
    opt = torch.optim.AdamW(ddp.parameters(), **_adamw_kwargs(lr, setting))
    return Peer(ddp, opt.step, lambda: opt.zero_grad(set_to_none=False), autocast=setting.autocast())


def build_torch_zero1(model: nn.Module, lr: float, bucket_mb: float, setting: Setting = CPU) -> Peer:
    """DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (torch's ZeRO-1: whole-tensor state sharding)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **setting.ddp_kwargs()
    )
    if setting.device.type == "cpu":
        ddp.register_comm_hook(None, ddp_counting_hook)
    kwargs = _adamw_kwargs(lr, setting)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)
    return Peer(ddp, opt.step, lambda: opt.zero_grad(set_to_none=False), autocast=setting.autocast())


def build_fsdp2(model: nn.Module, lr: float, reshard_after_forward: bool, setting: Setting = CPU) -> Peer:
    """FSDP2: ``fully_shard`` each transformer block, then the root; plain AdamW over the DTensor shards; under bf16
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the ZeRO stages' policy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(setting.device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=setting.low, reduce_dtype=torch.float32 if setting.low else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(lr, setting))
    return Peer(model, opt.step, lambda: opt.zero_grad(set_to_none=True))


def build_fsdp2_offload(model: nn.Module, lr: float, setting: Setting) -> Peer:
    """FSDP2 with ``CPUOffloadPolicy(pin_memory=True)``: sharded parameters, gradients and AdamW's state on the host,
    the optimizer step there after backward (FSDP2's design); blocks then root, as :func:`build_fsdp2`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(setting.device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=setting.low, reduce_dtype=torch.float32 if setting.low else None)
    policy = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(lr, setting))  # fused on the host's shards
    return Peer(model, opt.step, lambda: opt.zero_grad(set_to_none=True), info={"offload": "CPUOffloadPolicy"})


def build_ez_offload(model: nn.Module, lr: float, name: str, bucket_mb: float, setting: Setting) -> Peer:
    """``ZeroStage{2,3}`` with ZeRO-Offload (:data:`OFFLOAD_PEERS`), the step taken in backward as buckets land."""
    from elasticzero.engine.zero.offload import OffloadOptions

    stage = int(name.removeprefix("ez_stage")[0])
    options = OffloadOptions(optimizer=True, params=name == "ez_stage3_offload")
    peer = build_ez(model, lr, stage, bucket_mb, setting, offload=options)
    arm = peer.info.pop("stepping_in_backward")

    def backward(loss: torch.Tensor) -> None:
        with arm():
            loss.backward()

    peer.backward = backward
    peer.info["offload"] = str(options)
    return peer


def build_ez(
    model: nn.Module, lr: float, stage: int, bucket_mb: float, setting: Setting = CPU, offload: Any = None
) -> Peer:
    """elasticzero ``ZeroStage{stage}`` wrapping AdamW; reads the engine's own collective counter."""
    import elasticzero

    cls = getattr(elasticzero, f"ZeroStage{stage}")
    kwargs: dict[str, Any] = {"precision": setting.precision, **_adamw_kwargs(lr, setting)}
    if offload is not None:
        kwargs["offload"] = offload
    accepted = inspect.signature(cls).parameters
    for name in ("bucket_bytes", "reduce_bucket_bytes", "bucket_size_bytes"):
        if name in accepted:
            kwargs[name] = int(bucket_mb * 2**20)
    opt = cls(model, torch.optim.AdamW, **kwargs)
    stats = opt.comm_stats  # counts this optimizer's collectives, tagged by purpose

    def engine_comm() -> dict[str, int]:
        out: dict[str, int] = {}
        for (op, tag), n in stats.elements.items():
            if tag in ("grad", "param"):
                out[op] = out.get(op, 0) + n
        return out

    info: dict[str, Any] = {"kwargs": {k: v for k, v in kwargs.items() if k not in ("betas", "offload")}}
    if offload is not None:
        info["stepping_in_backward"] = opt.stepping_in_backward
    return Peer(
        model,
        opt.step,
        lambda: opt.zero_grad(set_to_none=True),
        engine_comm=engine_comm,
        memory_report=opt.memory_report,
        info=info,
    )


def build_ds(
    model: nn.Module, lr: float, stage: int, bucket_mb: float, batch_size: int, setting: Setting = CPU
) -> Peer:
    """DeepSpeed ZeRO ``stage`` on CPU (``DS_ACCELERATOR=cpu``, gloo) with a client ``torch.optim.AdamW``."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    bucket = int(bucket_mb * 2**20 / 4)  # DeepSpeed bucket sizes are in elements
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0})
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; no peer clips
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(lr, setting))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    info = {"deepspeed": deepspeed.__version__, "zero_optimization": zero}
    return Peer(engine, engine.step, lambda: None, backward=engine.backward, info=info)


def build(name: str, model: nn.Module, lr: float, bucket_mb: float, batch_size: int, setting: Setting = CPU) -> Peer:
    """Build peer ``name`` around ``model`` (already on ``setting.device``, same initial weights on every rank)."""
    if name.endswith(COMPILED_SUFFIX):
        return compile_blocks(build(name.removesuffix(COMPILED_SUFFIX), model, lr, bucket_mb, batch_size, setting))
    if name == "adamw":
        return build_adamw(model, lr, setting)
    if name == "ddp":
        return build_ddp(model, lr, bucket_mb, setting)
    if name == "torch_zero1":
        return build_torch_zero1(model, lr, bucket_mb, setting)
    if name in ("fsdp2", "fsdp2_keep"):
        return build_fsdp2(model, lr, name == "fsdp2", setting)
    if name == "fsdp2_offload":
        return build_fsdp2_offload(model, lr, setting)
    if name in OFFLOAD_PEERS:
        return build_ez_offload(model, lr, name, bucket_mb, setting)
    if name.startswith("ez_stage"):
        return build_ez(model, lr, int(name[-1]), bucket_mb, setting)
    if name.startswith("ds_stage"):
        return build_ds(model, lr, int(name[-1]), bucket_mb, batch_size, setting)
    raise ValueError(f"unknown peer {name!r}")


def compile_blocks(peer: Peer) -> Peer:
    """Compile each transformer block of the built peer in place (``block.compile()``, after the wrapper's hooks are on
    it, as a user of either engine would)."""
    for block in peer.net.blocks:
        block.compile()
    peer.info["compiled"] = "per block: block.compile() after wrapping (Inductor)"
    return peer


def preflight(name: str) -> str | None:
    """A reason to skip ``name`` in this interpreter (checked on every rank before any collective), or ``None``."""
    name = name.removesuffix(COMPILED_SUFFIX)
    try:
        if name.startswith("ez_stage"):
            import elasticzero

            getattr(elasticzero, f"ZeroStage{name.removeprefix('ez_stage')[0]}")
        elif name.startswith("ds_stage"):
            import deepspeed  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
