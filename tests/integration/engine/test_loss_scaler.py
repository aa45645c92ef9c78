"""LossScaler: dynamic/static scale sequence, GradScaler-shaped API, and overflow agreement over real gloo ranks."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticzero.engine.loss_scaler import LossScaler, LossScaleUnderflowError
from elasticzero.errors import UsageError
from ez_testing import free_port

WORLD = 2


# ------------------------------------------------------------------ single-process helpers
def _model_and_opt(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _iteration(scaler: LossScaler, model: torch.nn.Module, opt: Any, overflow: bool) -> Any:
    """One scaled step; ``overflow`` poisons one gradient with inf after backward."""
    opt.zero_grad()
    loss = model(torch.ones(1, 3, dtype=next(model.parameters()).dtype)).sum()
    scaler.scale(loss).backward()
    if overflow:
        model.weight.grad[0, 0] = math.inf
    out = scaler.step(opt)
    scaler.update()
    return out


def _scales(scaler: LossScaler, pattern: str) -> list[float]:
    """Run ``pattern`` ('.' clean step, 'x' overflow) and return the scale after each step."""
    model, opt = _model_and_opt()
    out = []
    for c in pattern:
        _iteration(scaler, model, opt, overflow=c == "x")
        out.append(scaler.get_scale())
    return out


# ------------------------------------------------------------------ dynamic scale sequence
def test_growth_after_interval_and_backoff_without_hysteresis() -> None:
    s = LossScaler(8.0, growth_interval=3, hysteresis=1)
    assert _scales(s, "...x..x...") == [8, 8, 16, 8, 8, 8, 4, 4, 4, 8]
    assert s.skipped_steps == 2


def test_hysteresis_tolerates_overflows_deepspeed_style() -> None:
    # hysteresis=2: the 2nd overflow reduces; a clean step does not refill the counter (only growth does) ...
    s = LossScaler(64.0, growth_interval=100, hysteresis=2)
    assert _scales(s, "x.x.x") == [64, 64, 32, 32, 16]
    # ... unless consecutive_hysteresis=True, where any clean step refills it
    s = LossScaler(64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True)
    assert _scales(s, "x.x.xx") == [64, 64, 64, 64, 64, 32]


def test_growth_refills_hysteresis() -> None:
    s = LossScaler(64.0, growth_interval=2, hysteresis=2)
    assert _scales(s, "xx..xx") == [64, 32, 32, 64, 64, 32]


def test_min_scale_clamps_then_raises() -> None:
    s = LossScaler(4.0, hysteresis=1, min_scale=1.5)
    assert _scales(s, "xx") == [2.0, 1.5]
    model, opt = _model_and_opt()
    with pytest.raises(LossScaleUnderflowError, match=r"below min_scale=1\.5"):
        _iteration(s, model, opt, overflow=True)


def test_static_scale_never_changes_but_skips_overflow() -> None:
    s = LossScaler(128.0, dynamic=False, growth_interval=1)
    assert _scales(s, "..x..") == [128.0] * 5
    assert s.skipped_steps == 1


# ------------------------------------------------------------------ GradScaler-shaped API
def test_step_applies_unscaled_gradients_and_skips_on_overflow() -> None:
    ref_model, ref_opt = _model_and_opt()
    ref_model(torch.ones(1, 3)).sum().backward()
    ref_opt.step()

    model, opt = _model_and_opt()
    s = LossScaler(1024.0)
    assert _iteration(s, model, opt, overflow=False) is None  # SGD.step returns None too ...
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=0, atol=0)
    before = model.weight.detach().clone()
    assert _iteration(s, model, opt, overflow=True) is None  # ... so check the skip by the params
    torch.testing.assert_close(model.weight, before, rtol=0, atol=0)
    assert s.skipped_steps == 1


def test_step_returns_optimizer_result() -> None:
    model, opt = _model_and_opt()
    s = LossScaler(4.0)
    s.scale(model(torch.ones(1, 3)).sum()).backward()
    assert s.step(opt, lambda: torch.tensor(7.0)) == torch.tensor(7.0)  # closure result passed through


def test_unscale_is_idempotent_within_a_step() -> None:
    model, opt = _model_and_opt()
    s = LossScaler(8.0)
    s.scale(model(torch.ones(1, 3)).sum()).backward()
    assert s.unscale_(opt) is False
    once = model.weight.grad.clone()
    torch.testing.assert_close(once, torch.ones(2, 3))
    assert s.unscale_(opt) is False
    s.step(opt)  # must not unscale again
    torch.testing.assert_close(model.weight.grad, once)
    with pytest.raises(RuntimeError, match="already called"):
        s.step(opt)
    s.update()


def test_update_without_step_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no unscale_"):
        LossScaler().update()


def test_fp16_gradients_are_unscaled_in_place() -> None:
    model, opt = _model_and_opt(torch.float16)
    s = LossScaler(256.0)
    s.scale(model(torch.ones(1, 3, dtype=torch.float16)).sum()).backward()
    assert model.weight.grad[0, 0].item() == 256.0
    s.unscale_(opt)
    assert model.weight.grad.dtype == torch.float16
    assert model.weight.grad[0, 0].item() == 1.0


def test_half_precision_loss_is_scaled_in_fp32() -> None:
    loss = torch.tensor(2.0, dtype=torch.float16, requires_grad=True)
    scaled = LossScaler(2.0**16).scale(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 2.0**17  # fp16 would be inf
    scaled.backward()
    assert loss.grad is not None and loss.grad.dtype == torch.float16 and torch.isinf(loss.grad)  # 65536 > 65504


def test_disabled_is_a_pass_through() -> None:
    model, opt = _model_and_opt()
    s = LossScaler(enabled=False)
    loss = model(torch.ones(1, 3)).sum()
    assert s.scale(loss) is loss
    loss.backward()
    model.weight.grad[0, 0] = math.inf
    s.step(opt)  # a disabled scaler does not check
    s.update()
    assert s.get_scale() == 1.0 and s.state_dict() == {} and s.skipped_steps == 0


class _OwnGradsOptimizer:
    """Stands in for a ZeRO stage: owns its gradients, reports a local flag through the protocol."""

    def __init__(self, found: float, process_group: Any = None) -> None:
        self.found, self.process_group = found, process_group
        self.param_groups: list[dict[str, Any]] = []
        self.inv_scales: list[float] = []
        self.steps = 0

    def unscale_(self, inv_scale: float) -> torch.Tensor:
        self.inv_scales.append(inv_scale)
        return torch.tensor(self.found)

    def step(self) -> str:
        self.steps += 1
        return "stepped"


def test_protocol_optimizer_unscales_itself() -> None:
    s = LossScaler(16.0, hysteresis=1)
    clean, bad = _OwnGradsOptimizer(0.0), _OwnGradsOptimizer(1.0)
    assert s.step(clean) == "stepped" and clean.inv_scales == [1 / 16]
    s.update()
    assert s.step(bad) is None and bad.steps == 0
    s.update()
    assert s.get_scale() == 8.0 and s.skipped_steps == 1


def test_state_dict_round_trip_continues_identically() -> None:
    a = LossScaler(64.0, growth_interval=3, hysteresis=2)
    _scales(a, "x.x..")
    sd = a.state_dict()
    b = LossScaler(2.0, growth_interval=50, hysteresis=5)  # settings come from the state dict
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    assert _scales(a, "..x.x..") == _scales(b, "..x.x..")
    assert a.skipped_steps == b.skipped_steps == 4


def test_load_state_dict_rejects_incomplete_state() -> None:
    with pytest.raises(UsageError, match="missing keys"):
        LossScaler().load_state_dict({"scale": 2.0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0.0}, "init_scale must be > 0"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"growth_interval": 0}, "growth_interval must be >= 1"),
        ({"hysteresis": 0}, "hysteresis must be >= 1"),
        ({"init_scale": 4.0, "min_scale": 8.0}, "min_scale must be in"),
    ],
)
def test_bad_settings_are_usage_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        LossScaler(**kwargs)


# ------------------------------------------------------------------ real gloo ranks
OVERFLOW_STEP = 2  # rank 1 alone overflows on this step
STEPS = 4


def _train(
    rank: int, model: torch.nn.Module, opt: Any, scaler: LossScaler, poison: torch.nn.Parameter, data_rank: int
) -> list[float]:
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.full((2, 4), float(data_rank + step + 1))
        scaler.scale(model(x).square().mean()).backward()
        if rank == 1 and step == OVERFLOW_STEP:
            poison.grad.view(-1)[0] = math.nan
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        results: dict[str, Any] = {}
        # 1. plain optimizer, no DDP, same data everywhere: rank 1's local NaN must make rank 0 skip as well
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = LossScaler(2.0**10, growth_interval=2, hysteresis=1)
        scales = _train(rank, model, opt, scaler, model.weight, data_rank=0)
        results["plain"] = (scales, scaler.skipped_steps, _flat(model))

        # 2. DDP + plain optimizer
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
        scaler = LossScaler(2.0**10, growth_interval=2, hysteresis=1)
        scales = _train(rank, ddp, opt, scaler, ddp.module.weight, data_rank=rank)
        results["ddp"] = (scales, scaler.skipped_steps, _flat(ddp.module))

        # 3. protocol optimizer on an explicit group: only rank 1 reports inf locally
        group = dist.new_group([0, 1])
        own = _OwnGradsOptimizer(found=float(rank == 1), process_group=group)
        scaler = LossScaler(8.0, hysteresis=1)
        scaler.step(own)
        scaler.update()
        results["protocol"] = (own.steps, scaler.skipped_steps, scaler.get_scale())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Any, args: tuple[Any, ...], timeout: float = 90.0) -> None:
    """Start ``WORLD`` processes running ``fn(rank, *args)``; fail (and kill them) after ``timeout`` seconds."""
    ctx = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    try:
        deadline = timeout
        while not ctx.join(timeout=1.0):
            deadline -= 1.0
            if deadline <= 0:
                raise TimeoutError(f"ranks still running after {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("scaler")
    run_ranks(_worker, (free_port(), str(out)))
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["plain", "ddp"])
def test_overflow_on_one_rank_skips_on_every_rank(two_rank_results: list[dict[str, Any]], case: str) -> None:
    (scales0, skipped0, params0), (scales1, skipped1, params1) = (r[case] for r in two_rank_results)
    # growth after 2 clean steps, backoff on the (agreed) overflow of step 2, and nothing else
    assert scales0 == scales1 == [2.0**10, 2.0**11, 2.0**10, 2.0**10]
    assert skipped0 == skipped1 == 1
    # identical everywhere (same data in "plain"; DDP averages) and finite: every rank skipped the same step
    assert torch.isfinite(params0).all()
    torch.testing.assert_close(params0, params1, rtol=0, atol=0)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_overflow_on_one_rank_skips_with_protocol_optimizer(two_rank_results: list[dict[str, Any]]) -> None:
    assert [r["protocol"] for r in two_rank_results] == [(0, 1, 4.0), (0, 1, 4.0)]


# ------------------------------------------------------------------ with ZeroStage2 (fp16): a local inf in one shard
def _zero_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        from elasticzero.engine.zero import ZeroStage2

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        opt = ZeroStage2(model, torch.optim.AdamW, lr=1e-2, precision="fp16", bucket_bytes=64)
        scaler = LossScaler(2.0**8, growth_interval=2, hysteresis=1)
        scales, changed = [], []
        for step in range(STEPS):
            before = opt.full_state_dict()
            x = torch.full((2, 4), float(rank + step + 1))
            scaler.scale(model(x).float().square().mean()).backward()
            if rank == 1 and step == OVERFLOW_STEP:
                opt.grad_shards()[0].view(-1)[0] = math.inf  # this rank's shard only: no collective spreads it
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            after = opt.full_state_dict()
            changed.append(any(not torch.equal(before[k], after[k]) for k in before))
            scales.append(scaler.get_scale())
        full = torch.cat([v.float().reshape(-1) for v in opt.full_state_dict().values()])
        torch.save((scales, changed, scaler.skipped_steps, full), os.path.join(out_dir, f"zero{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_fp16_zero_stage2_forced_overflow_skips_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("elasticzero.engine.zero.stage2", reason="ZeroStage2 not available")
    run_ranks(_zero_worker, (free_port(), str(tmp_path)))
    (s0, c0, k0, p0), (s1, c1, k1, p1) = (torch.load(tmp_path / f"zero{r}.pt") for r in range(WORLD))
    assert s0 == s1 == [2.0**8, 2.0**9, 2.0**8, 2.0**8]
    assert c0 == c1 == [True, True, False, True]  # step 2 skipped everywhere, the others applied
    assert k0 == k1 == 1
    assert torch.isfinite(p0).all()
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)
