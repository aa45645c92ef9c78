"""The accelerate front door's pure decisions (``elasticzero.integrations.accelerate``): which setups it refuses,
who clips, where checkpoints go, what a checkpoint holds. The door itself trains in
``tests/integration/integrations/test_accelerate.py``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from elasticzero.errors import UsageError
from ez_testing import require

HAVE = importlib.util.find_spec("accelerate") is not None
if HAVE:
    from accelerate.utils import DistributedType

    from elasticzero.integrations.accelerate import (
        check_distributed,
        check_window,
        checkpoint_state,
        clip_route,
        state_directory,
    )


@pytest.fixture(autouse=True)
def _accelerate() -> None:
    require(HAVE, "accelerate not installed (the test extra pins it)")


@pytest.mark.parametrize("kind", ["NO", "MULTI_CPU", "MULTI_GPU"])
def test_plain_data_parallel_setups_are_accepted(kind: str) -> None:
    check_distributed(DistributedType[kind], "no", 1 if kind == "NO" else 2)


@pytest.mark.parametrize(
    ("kind", "precision", "world", "fix"),
    [
        ("DEEPSPEED", "no", 2, "--use_deepspeed"),
        ("FSDP", "no", 2, "--use_fsdp"),
        ("MULTI_CPU", "bf16", 2, "precision='bf16'"),
        ("MULTI_GPU", "fp16", 2, "--mixed_precision no"),
        ("NO", "no", 2, "ACCELERATE_USE_CPU=1"),
    ],
)
def test_setups_the_engine_cannot_share_are_refused_with_the_fix(
    kind: str, precision: str, world: int, fix: str
) -> None:
    with pytest.raises(UsageError, match=f"ZeroAccelerator: .*{re.escape(fix)}"):
        check_distributed(DistributedType[kind], precision, world)


def test_the_engine_clips_all_of_its_parameters_torch_clips_none_of_them() -> None:
    assert clip_route([1, 2, 3, 9], [1, 2, 3]) == "engine"
    assert clip_route(iter([1, 2, 3]), iter([3, 2, 1])) == "engine"
    assert clip_route([7, 8], [1, 2, 3]) == "torch"
    with pytest.raises(UsageError, match=r"2 of the ZeRO optimizer's 3 parameters given.*model.parameters"):
        clip_route([1, 2], [1, 2, 3])


def test_checkpoints_go_to_the_given_directory_or_accelerates_automatic_one(tmp_path: Path) -> None:
    assert state_directory(tmp_path / "ck", None, automatic=False) == tmp_path / "ck"
    assert state_directory("ignored", tmp_path, automatic=True) == tmp_path / "checkpoints"
    with pytest.raises(UsageError, match="project_dir"):
        state_directory(None, None, automatic=True)
    with pytest.raises(UsageError, match="pass the checkpoint directory"):
        state_directory(None, tmp_path, automatic=False)


class _Stateful:
    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        del state


def test_a_checkpoint_holds_model_counters_scaler_schedulers_custom_objects_and_rng() -> None:
    model, scaler, sched, custom = _Stateful(), _Stateful(), _Stateful(), _Stateful()
    counters = {"steps": 3}
    state = checkpoint_state(model, counters, scaler, [sched], [custom])  # type: ignore[arg-type]
    assert sorted(state) == ["accelerate", "custom0", "model", "rng", "scaler", "scheduler0"]
    assert state["model"] is model and state["scaler"] is scaler and state["scheduler0"] is sched
    assert state["accelerate"] == counters and state["accelerate"] is not counters  # loaded in place, not the caller's
    assert "scaler" not in checkpoint_state(model, counters, None, [], [])  # type: ignore[arg-type]


def test_a_save_is_taken_on_an_accumulation_boundary_only() -> None:
    for micro_step in (0, 4, 8):
        check_window(micro_step, 4)
    check_window(7, 1)
    with pytest.raises(UsageError, match=r"micro-batch 2 of an accumulation window of 4.*sync_gradients"):
        check_window(6, 4)


def test_the_accelerate_internals_the_door_relies_on_are_there() -> None:
    """Canaries: the non-public accelerate names ``ZeroAccelerator`` reads or sets still mean what it relies on (the
    pinned accelerate has them; a new release that drops one fails here, naming it)."""
    import inspect

    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    relied = {
        Accelerator.prepare_model: "_is_accelerate_prepared",  # a marked model is returned as it is: no DDP, no move
        Accelerator.prepare_optimizer: "_is_accelerate_prepared",  # a marked optimizer is kept, not re-wrapped
        Accelerator.save_state: "self._schedulers",  # what accelerate's own save_state saves: the prepared schedulers
        Accelerator.register_for_checkpointing: "self._custom_objects",  # and the registered objects
        Accelerator._do_sync: "self.step % self.gradient_state.num_steps",  # the window counter load_state resets
        AcceleratedOptimizer.step_was_skipped.fget: "self._is_overflow",  # the flag ZeroAcceleratedOptimizer sets
    }
    missing = [f"{f.__qualname__}: {name}" for f, name in relied.items() if name not in inspect.getsource(f)]
    assert not missing, f"accelerate changed: {missing}; used in src/elasticzero/integrations/accelerate.py"
