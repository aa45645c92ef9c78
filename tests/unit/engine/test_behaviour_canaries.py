"""Canaries for behaviours (not names) of torch and transformers the engine relies on; see docs/architecture.md,
"Behaviours we rely on". Each fails with what changed and where we depend on it."""

from __future__ import annotations

import importlib.util
import inspect

import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn_functional
from torch import nn

from elasticzero.engine import hf
from elasticzero.engine.zero import comm
from ez_testing import require


def test_dist_nn_functional_binds_its_group_default_at_import() -> None:
    """comm.default_group_pinned reads torch.distributed.nn.functional.all_reduce's defaults: the group default is
    evaluated when that module is imported (so importing it after init_process_group pins the default group)."""
    group = inspect.signature(dist_nn_functional.all_reduce).parameters.get("group")
    assert group is not None, "torch changed torch.distributed.nn.functional.all_reduce: no `group` parameter"
    defaults = dist_nn_functional.all_reduce.__defaults__ or ()
    assert any(d is group.default for d in defaults), (
        "torch changed torch.distributed.nn.functional.all_reduce: its group default is no longer a plain default "
        "argument; revisit engine/zero/comm.py default_group_pinned (see docs/architecture.md)"
    )
    assert not comm.default_group_pinned() or dist.is_initialized()


def test_transformers_reads_the_sharded_flag_that_stage3_sets() -> None:
    """engine/hf.mark_sharded sets FSDP2's flag on the stage-3 root so HF generate() turns on synced_gpus."""
    require(importlib.util.find_spec("transformers") is not None, "transformers not installed (the test extra)")
    from transformers.distributed.fsdp import is_fsdp_managed_module

    module = nn.Linear(2, 2)
    assert not is_fsdp_managed_module(module)
    hf.mark_sharded(module)
    assert is_fsdp_managed_module(module) or not dist.is_available(), (
        f"transformers no longer reads {hf.SHARDED_FLAG!r}: stage-3 generate() needs synced_gpus=True passed by hand; "
        "revisit engine/hf.py (see docs/architecture.md)"
    )
