"""build_pieces: plain optimizer at stage 0 (single process), ZeroStageN from a ds_config on real gloo ranks."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticzero.config.build import EnginePieces, build_pieces
from elasticzero.config.load import config_from_dict
from elasticzero.engine.loss_scaler import LossScaler
from elasticzero.errors import UsageError
from ez_testing import free_port

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_stage0_fp32_gives_plain_optimizer_and_no_scaler() -> None:
    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "clip_grad_norm": 0.5,
        "accumulation_steps": 3,
        "micro_batch_size": 2,
    }
    pieces = build_pieces(_model(), cfg)
    assert isinstance(pieces, EnginePieces)
    assert type(pieces.optimizer) is torch.optim.SGD
    assert pieces.optimizer.defaults["momentum"] == 0.9
    assert pieces.scaler is None and pieces.autocast_dtype is None
    assert pieces.timers.enabled is False
    assert (pieces.accumulation_steps, pieces.micro_batch_size, pieces.clip_grad_norm) == (3, 2, 0.5)
    assert pieces.precision.param_dtype == torch.float32


def test_stage0_fp16_gives_autocast_dtype_scaler_and_clipping() -> None:
    model = _model()
    ds = {
        "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 7, "hysteresis": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
        "gradient_clipping": 1e-3,
        "wall_clock_breakdown": True,
    }
    pieces = build_pieces(model, ds)
    assert type(pieces.optimizer) is torch.optim.AdamW
    assert pieces.optimizer.defaults["betas"] == (0.8, 0.9)
    assert pieces.autocast_dtype == torch.float16
    assert isinstance(pieces.scaler, LossScaler)
    sd = pieces.scaler.state_dict()
    assert (sd["scale"], sd["growth_interval"], sd["hysteresis"], sd["dynamic"]) == (16.0, 7, 3, True)
    assert pieces.timers.enabled
    model(torch.ones(3, 4)).sum().backward()
    norm = pieces.clip_grad_norm_()
    assert norm is not None and norm > 1e-3
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    # torch scales by max_norm / (norm + 1e-6): the clipped norm is max_norm * norm / (norm + 1e-6). Each fp32 norm
    # (torch's and this one) sums n squares, at most (n - 1) roundings of 2^-24 relative in any order; the
    # coefficient and the scaling add 3 more: (n + 4) * 2^-24 on any CPU
    want = 1e-3 * norm.item() / (norm.item() + 1e-6)
    rtol = (grads.numel() + 4) * torch.finfo(torch.float32).eps / 2
    torch.testing.assert_close(grads.norm(), torch.tensor(want), rtol=rtol, atol=0)


def test_loss_scaling_can_be_forced_on_or_off() -> None:
    on = build_pieces(_model(), {"precision": {"dtype": "bf16", "loss_scale": {"enabled": True, "dynamic": False}}})
    assert on.scaler is not None and on.scaler.dynamic is False
    off = build_pieces(_model(), {"precision": {"dtype": "fp16", "loss_scale": {"enabled": False}}})
    assert off.scaler is None and off.clip_grad_norm_() is None


def test_build_checks_batch_sizes_against_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_dict({"train_batch_size": 8, "micro_batch_size": 2, "accumulation_steps": 2}, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "3")  # the run is bigger than the config says
    with pytest.raises(UsageError, match="contradictory batch sizes: train_batch_size=8 != micro batch 2"):
        build_pieces(_model(), cfg)


# ------------------------------------------------------------------ ZeRO stages on real gloo ranks
DS_STAGE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.0}},
    "fp16": {"enabled": True, "initial_scale_power": 8},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 16},
}


def _worker(rank: int, port: int, out_dir: str, stages: list[int]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        results: dict[int, Any] = {}
        for stage in stages:
            model = _model()
            extra = ["zero.prefetch=false", "timers.enabled=true"] if stage == 3 else []
            pieces = build_pieces(model, DS_STAGE, overrides=[f"zero.stage={stage}", *extra])
            opt, scaler, acc = pieces.optimizer, pieces.scaler, pieces.accumulation
            assert scaler is not None
            for micro in range(4):  # two optimizer steps of two micro-batches
                x = torch.full((2, 4), float(rank + micro + 1))
                with acc.no_sync(opt):  # the documented loop: backward inside (stage 3: a plain context)
                    scaler.scale(acc.scale_loss(model(x).float().square().mean())).backward()
                if acc.advance():
                    scaler.unscale_(opt)
                    pieces.clip_grad_norm_()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
            full = torch.cat([v.float().reshape(-1) for v in opt.full_state_dict().values()])
            results[stage] = {
                "class": type(opt).__name__,
                "inner": type(opt.optim).__name__,
                "bucket_bytes": getattr(opt, "bucket_bytes", None),
                "same_group": scaler.process_group is opt.process_group,
                "prefetch": getattr(opt, "prefetch", None),
                "timers": opt.timers is pieces.timers,
                "timed": sorted(pieces.timers.summary()["phases"]),
                "skipped": scaler.skipped_steps,
                "full": full,
                "reduce_scatters": opt.comm_stats.calls[("reduce_scatter", "grad")],
                "nbuckets": len(opt.buckets),
            }
        for sync in (True, False):  # each rank's module filled with its rank: broadcast from rank 0, or left as it is
            probe = _model()
            with torch.no_grad():
                for p in probe.parameters():
                    p.fill_(float(rank))
            built = build_pieces(probe, DS_STAGE, overrides=["zero.stage=1"], sync_module_states=sync)
            values = {v for p in probe.parameters() for v in p.detach().float().flatten().tolist()}
            results[f"sync={sync}"] = sorted(values)
            built.optimizer.release()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(stages: list[int], out: Path) -> list[dict[int, Any]]:
    args = (free_port(), str(out), stages)
    ctx = mp.start_processes(_worker, args=args, nprocs=WORLD, join=False, start_method="spawn")
    try:
        for _ in range(110):
            if ctx.join(timeout=1.0):
                break
        else:
            raise TimeoutError("ranks still running after 110 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_ds_config_builds_zero_stages_that_train(tmp_path: Path) -> None:
    pytest.importorskip("elasticzero.engine.zero.stage2", reason="ZeRO stages not available")
    stages = [1, 2]
    try:
        import elasticzero.engine.zero.stage3  # noqa: F401

        stages.append(3)
    except ImportError:
        pass
    r0, r1 = _run(stages, tmp_path)
    for stage in stages:
        a, b = r0[stage], r1[stage]
        assert a["class"] == f"ZeroStage{stage}" and a["inner"] == "AdamW"
        if stage < 3:
            assert a["bucket_bytes"] == 16 * 4  # 16 elements of the fp32 reduction
            assert a["timers"] is False  # timers off: the stage gets None
        else:  # stage-3 options and timers reach the stage
            assert a["prefetch"] is False and a["timers"] is True and a["timed"]
        assert a["same_group"] and a["skipped"] == b["skipped"] == 0
        # no_sync deferred the first micro-batch of each step (stages 1/2); stage 3 reduces every backward
        backwards = 4 if stage == 3 else 2
        assert a["reduce_scatters"] == b["reduce_scatters"] == backwards * a["nbuckets"]
        assert torch.isfinite(a["full"]).all()
        torch.testing.assert_close(a["full"], b["full"], rtol=0, atol=0)
    if 1 in stages and 2 in stages:  # same math, different sharding
        torch.testing.assert_close(r0[1]["full"], r0[2]["full"])
    # sync_module_states: the module's state broadcast from rank 0 at construction (default), or not at all
    assert [r0["sync=True"], r1["sync=True"], r0["sync=False"], r1["sync=False"]] == [[0.0], [0.0], [0.0], [1.0]]
