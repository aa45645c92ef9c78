"""EnginePieces drive one loop at every stage: ``wrap`` (DDP at stage 0), ``autocast``, ``backward``, ``step`` and
``stateful`` (what a checkpoint holds), on a real single-rank gloo group."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elasticzero.checkpoint import Checkpointer, ReplicatedState
from elasticzero.config.build import EnginePieces, build_pieces
from elasticzero.engine.zero import ZeroCheckpointState
from ez_testing import free_port

CFG = {
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "clip_grad_norm": 0.05,  # below the gradients' norm: the clip changes the update
    "micro_batch_size": 4,
    "accumulation_steps": 2,
}


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(n)]


def _train(pieces: EnginePieces, net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The loop of ``build_pieces``' docstring, the same at every stage."""
    acc, opt = pieces.accumulation, pieces.optimizer
    for x, y in batches:
        with acc.no_sync(net, opt):
            with pieces.autocast():
                loss = acc.scale_loss((net(x).float() - y).square().mean())
            pieces.backward(loss)
        if acc.advance():
            pieces.step()


def test_stage0_fp16_wraps_in_ddp_autocasts_and_steps_as_written_out(world1: None) -> None:
    model = _model()
    pieces = build_pieces(model, {**CFG, "precision": {"dtype": "fp16"}, "zero": {"stage": 0}})
    net = pieces.wrap(model)
    assert isinstance(net, nn.parallel.DistributedDataParallel) and net.module is model
    with pieces.autocast():
        assert net(torch.ones(2, 6)).dtype == torch.float16
    assert net(torch.ones(2, 6)).dtype == torch.float32
    state = pieces.stateful(model)
    assert state.keys() == {"model", "scaler"} and isinstance(state["model"], ReplicatedState)
    assert state["scaler"] is pieces.scaler
    _train(pieces, net, _micro_batches(4))

    ref = _model()  # the same two steps written out: autocast, scaled backward, unscale, clip, step, update
    ref_pieces = build_pieces(ref, {**CFG, "precision": {"dtype": "fp16"}, "zero": {"stage": 0}})
    ref_net, ref_opt, scaler = nn.parallel.DistributedDataParallel(ref), ref_pieces.optimizer, ref_pieces.scaler
    assert scaler is not None
    for i, (x, y) in enumerate(_micro_batches(4)):
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref_net(x)
        scaler.scale((out.float() - y).square().mean() / 2).backward()
        if i % 2 == 1:
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert not torch.equal(model[0].weight, _model()[0].weight)


def test_stage2_trains_the_model_itself_and_checkpoints_zero_state(world1: None) -> None:
    model = _model()
    pieces = build_pieces(model, {**CFG, "zero": {"stage": 2}})
    assert pieces.wrap(model) is model and pieces.scaler is None
    with pieces.autocast():
        assert model(torch.ones(2, 6)).dtype == torch.float32
    state = pieces.stateful(model)
    assert state.keys() == {"model"} and isinstance(state["model"], ZeroCheckpointState)


@pytest.mark.parametrize("stage", [0, 2])
def test_stateful_round_trips_through_a_checkpoint(world1: None, tmp_path: Path, stage: int) -> None:
    """Train two steps, save, train two more; a fresh job loading the checkpoint trains the same two more (at the
    schedule's learning rates: the scheduler is in the checkpoint; its lr moves at every step here)."""
    schedule = {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_max_lr": 0.02}}
    cfg = {**CFG, "zero": {"stage": stage}, "scheduler": schedule}
    model = _model()
    pieces = build_pieces(model, cfg)
    net, ckpt = pieces.wrap(model), Checkpointer(tmp_path, keep_last=1)
    batches = _micro_batches(8)
    _train(pieces, net, batches[:4])
    ckpt.save(2, pieces.stateful(model))
    _train(pieces, net, batches[4:])
    expected = copy.deepcopy(model.state_dict())

    fresh = _model()
    resumed = build_pieces(fresh, cfg)
    assert resumed.stateful(fresh).keys() == {"model", "scheduler"}
    assert ckpt.load_latest(resumed.stateful(fresh)) == 2
    assert resumed.scheduler is not None and resumed.scheduler.last_batch_iteration == 1
    _train(resumed, resumed.wrap(fresh), batches[4:])
    ckpt.close()
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_offload_reaches_the_stage_and_the_boundary_backward_arms_its_early_step(world1: None, clip: float) -> None:
    """``zero.offload`` becomes the stage's ``offload=`` (on the CPU the identity); on the host path (``cpu_copies``)
    ``pieces.backward`` arms the step in backward on the accumulation boundary only, and not under clipping; the
    training equals the same pieces without offload."""
    from elasticzero import ZeroStage2
    from elasticzero.engine.zero.offload import OffloadOptions

    cfg = {**CFG, "clip_grad_norm": clip, "zero": {"stage": 2, "offload": {"optimizer": True}}}
    pieces = build_pieces(_model(), cfg)
    assert pieces.optimizer.options.offload == OffloadOptions(optimizer=True)  # type: ignore[attr-defined]
    assert not pieces.optimizer.home(0).host  # type: ignore[attr-defined]  # the CPU: state already in host memory
    host = ZeroStage2(_model(), torch.optim.AdamW, lr=0.01, offload=OffloadOptions(optimizer=True, cpu_copies=True))
    pieces = dataclasses.replace(pieces, optimizer=host)
    plain = build_pieces(_model(), {**CFG, "clip_grad_norm": clip, "zero": {"stage": 2}})
    armed = []
    for x, y in _micro_batches(4):
        for p in (pieces, plain):
            net, acc = p.optimizer.module, p.accumulation  # type: ignore[attr-defined]
            with acc.no_sync(net, p.optimizer):
                p.backward(acc.scale_loss((net(x) - y).square().mean()))
            if p is pieces:
                armed.append(bool(host._offload._steps.stepped))  # submitted during that backward
            if acc.advance():
                p.step()
    assert armed == ([False, True, False, True] if clip == 0 else [False] * 4)
    assert all(torch.equal(a, b) for a, b in zip(host.masters, plain.optimizer.masters, strict=True))  # type: ignore[attr-defined]
