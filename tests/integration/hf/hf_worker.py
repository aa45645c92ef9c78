"""Worker side of the Hugging Face model tests: tiny random-init ``transformers`` models (built from configs, nothing
downloaded; the parent sets ``HF_HUB_OFFLINE=1``) trained under ZeroStage1/2/3 on real gloo ranks, compared with a
reference each rank computes itself.

Reference: plain ``torch.optim.AdamW`` + ``clip_grad_norm_`` on one process, the gradient being the mean of the
per-rank micro-batch gradients (what data parallelism computes, also when ranks hold different token counts, as the
MLM does); for the BatchNorm network (HF ResNet) the reference is ``DistributedDataParallel`` (BatchNorm statistics
are per rank). The reference runs twice, in fp32 and in float64 (the truth): an fp32 ZeRO run may be off the truth
by what rounding moved the fp32 reference on this machine (``ez_numerics.error_ratio``, reported as ``*_ratio``).
Every rank writes ``{metric: value}`` to ``report.rank<r>.json``; the test asserts on all of them.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elasticzero import ZeroStage1, ZeroStage2, ZeroStage3
from elasticzero.engine import hf
from ez_numerics import error_ratio

VOCAB, SEQ, PER_RANK, STEPS, LR, WD, MAX_NORM = 128, 8, 2, 3, 1e-3, 0.01, 0.5
STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}
MODELS = ["gpt2", "bert", "t5", "llama", "resnet"]
TINY = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 4}


def build(name: str) -> nn.Module:
    """The tiny model ``name`` with a fixed random initialisation (same on every rank and call)."""
    import transformers  # here, so that the test module imports this one to learn the models without it

    torch.manual_seed(0)
    if name == "gpt2":
        cfg: Any = transformers.GPT2Config(n_positions=SEQ * 4, n_embd=32, **TINY)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "bert":  # masked LM: decoder weight tied to the word embeddings
        cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, max_position_embeddings=SEQ * 4, **TINY)
        return transformers.BertForMaskedLM(cfg)
    if name == "t5":  # encoder-decoder, shared embedding tied into both stacks and the head
        cfg = transformers.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0
        )
        return transformers.T5ForConditionalGeneration(cfg)
    if name == "llama":  # grouped-query attention: 4 query heads over 2 key/value heads
        cfg = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=SEQ * 4, **TINY
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    return transformers.ResNetForImageClassification(cfg)


def make_batch(name: str, step: int, rank: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step`` (deterministic; images in ``dtype``)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "resnet":
        pixels = torch.randn(PER_RANK, 3, 16, 16, generator=g).to(dtype)
        return {"pixel_values": pixels, "labels": torch.arange(PER_RANK)}
    ids = torch.randint(4, VOCAB, (PER_RANK, SEQ), generator=g)
    if name == "bert":  # mask 3 + rank positions per row: token counts differ between ranks
        labels = torch.full_like(ids, -100)
        labels[:, : 3 + rank] = ids[:, : 3 + rank]
        return {"input_ids": torch.where(labels == -100, ids, 3), "labels": labels}
    return {"input_ids": ids, "labels": ids}


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max |a - b| / max(max |b|, floor)`` (0 when both are zero)."""
    scale = max(b.detach().abs().max().item(), floor)
    diff = (a.detach().float() - b.detach().float()).abs().max().item()
    return diff / scale if scale else diff


# Gradients that are zero in exact arithmetic (softmax ignores a bias added to every key of a query): what remains is
# rounding noise, which Adam scales up to full-size updates in random directions; not comparable between two runs.
NOISE_ONLY = (".attention.self.key.bias",)


# Tensors that start at zero (biases, BatchNorm shifts) are only ~LR * STEPS in size after the run: their relative
# difference is taken against at least this scale (1e-6 of it is an absolute 1e-8).
SCALE_FLOOR = 1e-2


def worst_rel(sd: dict[str, torch.Tensor], ref: nn.Module) -> tuple[float, str]:
    """The largest per-tensor relative difference and the parameter it is in."""
    return max((rel(sd[k], p, SCALE_FLOOR), k) for k, p in ref.named_parameters() if not k.endswith(NOISE_ONLY))


def comparable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters an fp32 run is compared on (all but the noise-only ones)."""
    return {k: p.detach() for k, p in model.named_parameters() if not k.endswith(NOISE_ONLY)}


def train_mode(name: str, model: nn.Module) -> nn.Module:
    # language models without dropout (eval: ranks and the reference draw no random masks); ResNet in train mode
    return model.train() if name == "resnet" else model.eval()


def reference(
    name: str, rank: int, world: int, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, list[float], list[float]]:
    """The trained reference model (in ``dtype``), its global loss and gradient norm per step."""
    model = train_mode(name, build(name).to(dtype))
    if name == "resnet":
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
        losses, norms = [], []
        for step in range(STEPS):
            loss = ddp(**make_batch(name, step, rank, dtype)).loss
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
            losses.append(_global_mean(loss))
        return model, losses, norms
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for r in range(world):
            loss = model(**make_batch(name, step, r)).loss / world
            loss.backward()
            total += loss.item()
        unused = [n for n, p in model.named_parameters() if p.grad is None]
        assert not unused, f"{name}: parameters without gradient {unused[:3]}"
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses, norms


def _global_mean(loss: torch.Tensor) -> float:
    t = loss.detach().to(torch.promote_types(loss.dtype, torch.float32)).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def zero_run(name: str, stage: int, precision: str, rank: int) -> tuple[nn.Module, Any, list[float], list[float]]:
    model = train_mode(name, build(name))
    opt = STAGES[stage](model, torch.optim.AdamW, lr=LR, weight_decay=WD, precision=precision)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(**make_batch(name, step, rank)).loss
        loss.backward()
        norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(loss))
    return model, opt, losses, norms


def seq_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def check_export(name: str, model: nn.Module, opt: Any, directory: str) -> dict[str, Any]:
    """:func:`elasticzero.engine.hf.save_pretrained`, then ``from_pretrained`` on rank 0: fp32, equal to the masters."""
    full = opt.full_state_dict()
    hf.save_pretrained(model, opt, directory)
    dist.barrier()
    loaded = type(model).from_pretrained(directory)
    dtypes = sorted({str(p.dtype) for p in loaded.parameters()})
    diff = max(rel(p, full[k]) for k, p in loaded.state_dict().items() if k in full)
    missing = [k for k in full if k not in loaded.state_dict()]
    dist.barrier()
    return {
        "export_rel": diff,
        "export_dtypes": dtypes,
        "export_missing": missing,
        "export_config_dtype": str(loaded.config.dtype),
    }


def check_generate(name: str, model: nn.Module, ref: nn.Module, rank: int) -> dict[str, Any]:
    """Stage-3 ``generate()`` with ranks stopping at different lengths, as HF decides (``synced_gpus`` on by
    itself) and with ``synced_gpus=True`` explicitly; greedy tokens must equal the reference model's."""
    out: dict[str, Any] = {}
    ids = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7 + rank))
    kwargs = {"max_new_tokens": 2 + 3 * rank, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = ref.generate(ids, **kwargs).tolist()
        out["gen_default_equal"] = model.generate(ids, **kwargs).tolist() == want
        out["gen_synced_equal"] = model.generate(ids, synced_gpus=True, **kwargs).tolist() == want
    out["gen_len"] = len(want[0])
    return out


def run_model(name: str, rank: int, world: int, tmp: str, record: Callable[[str, Any], None]) -> None:
    ref, ref_losses, ref_norms = reference(name, rank, world)
    truth, truth_losses, truth_norms = reference(name, rank, world, torch.float64)
    record(f"{name}_clipped_steps", sum(n > MAX_NORM for n in ref_norms))
    for stage in STAGES:
        model, opt, losses, norms = zero_run(name, stage, "fp32", rank)
        record(f"{name}_s{stage}_fp32_ratio", error_ratio(opt.full_state_dict(), comparable(ref), comparable(truth)))
        record(f"{name}_s{stage}_fp32_worst", worst_rel(opt.full_state_dict(), ref))  # information only
        record(f"{name}_s{stage}_loss_ratio", error_ratio(losses, ref_losses, truth_losses))
        record(f"{name}_s{stage}_norm_ratio", error_ratio(norms, ref_norms, truth_norms))
        if stage == 3 and name in ("gpt2", "t5", "llama"):
            for k, v in check_generate(name, model, ref, rank).items():
                record(f"{name}_s{stage}_{k}", v)
        del model, opt
        model, opt, losses, _ = zero_run(name, stage, "bf16", rank)
        record(f"{name}_s{stage}_bf16_loss_rel", seq_rel(losses, ref_losses))
        full = opt.full_state_dict()
        num = sum((full[k].float() - p.detach()).pow(2).sum().item() for k, p in ref.named_parameters())
        den = sum(p.detach().pow(2).sum().item() for p in ref.parameters())
        record(f"{name}_s{stage}_bf16_param_rel", (num / den) ** 0.5)
        for k, v in check_export(name, model, opt, os.path.join(tmp, f"{name}_s{stage}")).items():
            record(f"{name}_s{stage}_bf16_{k}", v)


def worker(rank: int, world: int, port: int, tmp: str, models: list[str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    out: dict[str, Any] = {}
    try:
        for name in models:
            start = time.perf_counter()
            run_model(name, rank, world, tmp, out.__setitem__)
            out[f"{name}_seconds"] = time.perf_counter() - start  # information only (no test asserts on time)
        dist.barrier()
    except Exception:
        out["error"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(tmp, f"report.rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)
        dist.destroy_process_group()
