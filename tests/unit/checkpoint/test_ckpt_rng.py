"""RNGState: per-rank generators saved in the checkpoint and restored at the same world size (world size 1 here;
the 2-rank and world-change cases run in tests/integration/checkpoint)."""

from __future__ import annotations

import random
import socket

import pytest
import torch
import torch.distributed as dist

from elasticzero.checkpoint import Checkpointer
from elasticzero.checkpoint.rng import RNGState
from elasticzero.errors import UsageError


@pytest.fixture(scope="module")
def world1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def draws() -> tuple[list[float], list[float]]:
    return torch.rand(4).tolist(), [random.random() for _ in range(4)]


def test_resume_continues_the_same_streams(world1, tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    draws()
    ckpt = Checkpointer(tmp_path, keep_last=1)
    rng = RNGState()
    ckpt.save(1, {"rng": rng})
    expected = draws()
    torch.manual_seed(99)  # a restarted script seeds again
    random.seed(99)
    assert ckpt.load_latest({"rng": rng}) == 1
    assert rng.restored is True
    assert draws() == expected
    ckpt.close()


class TwoRanks(RNGState):
    """What the state looks like at world size 2 (this test runs one rank)."""

    def state_dict(self):
        saved = super().state_dict()
        return {**saved, "world_size": 2, "ranks": saved["ranks"] * 2}


def test_saved_at_another_world_size_loads_and_leaves_the_generators_alone(world1, tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, {"rng": TwoRanks()})
    torch.manual_seed(5)
    before = torch.get_rng_state()
    rng = RNGState()
    assert ckpt.load_latest({"rng": rng}) == 1  # one entry, whatever the world size: the template matches
    assert rng.restored is False
    assert torch.equal(torch.get_rng_state(), before)
    ckpt.save(2, {"rng": RNGState()})  # and the other way: a template of two ranks loads a one-rank save
    assert ckpt.load_latest({"rng": TwoRanks()}) == 2
    ckpt.close()


def test_another_world_size_leaves_the_generators_alone(world1):
    rng = RNGState()
    saved = rng.state_dict()
    saved["world_size"] = 2
    saved["ranks"] = saved["ranks"] * 2
    torch.manual_seed(5)
    before = torch.get_rng_state()
    rng.load_state_dict(saved)
    assert rng.restored is False
    assert torch.equal(torch.get_rng_state(), before)


def test_unknown_version_is_one_clear_error(world1):
    rng = RNGState()
    saved = {**rng.state_dict(), "version": 7}
    with pytest.raises(UsageError, match="unknown state version 7"):
        rng.load_state_dict(saved)
