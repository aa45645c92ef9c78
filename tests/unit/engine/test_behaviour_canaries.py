"""Canaries for behaviours (not names) of torch and transformers the engine relies on; see docs/architecture.md,
"Behaviours we rely on". Each fails with what changed and where we depend on it."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn_functional
from torch import nn

from elasticzero.engine import hf
from elasticzero.engine.zero.comm import patching
from ez_testing import require


def test_dist_nn_functional_binds_its_group_default_at_import() -> None:
    """patching.default_group_pinned reads torch.distributed.nn.functional.all_reduce's defaults: the group default is
    evaluated when that module is imported (so importing it after init_process_group pins the default group)."""
    group = inspect.signature(dist_nn_functional.all_reduce).parameters.get("group")
    assert group is not None, "torch changed torch.distributed.nn.functional.all_reduce: no `group` parameter"
    defaults = dist_nn_functional.all_reduce.__defaults__ or ()
    assert any(d is group.default for d in defaults), (
        "torch changed torch.distributed.nn.functional.all_reduce: its group default is no longer a plain default "
        "argument; revisit engine/zero/comm/patching.py default_group_pinned (see docs/architecture.md)"
    )
    assert not patching.default_group_pinned() or dist.is_initialized()


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


def test_compile_traces_a_module_marked_sharded_as_fsdp2s() -> None:
    """engine/hf.mark_sharded sets both flags torch's fully_shard sets: Dynamo refuses a module carrying only
    _is_fsdp_managed_module (FSDP1's flat parameters; the whole frame runs eagerly) and reads _fsdp_use_orig_params to
    trace it as FSDP2's (its parameters the graph's inputs)."""
    from torch._dynamo.variables import builder
    from torch.distributed.fsdp._fully_shard import _fully_shard

    where = "revisit engine/hf.py mark_sharded (see docs/architecture.md)"
    dynamo, shard = inspect.getsource(builder), inspect.getsource(_fully_shard)
    for flag in (hf.SHARDED_FLAG, hf.ORIG_PARAMS_FLAG):
        assert flag in dynamo, f"torch.compile (torch._dynamo.variables.builder) no longer reads {flag!r}: {where}"
        assert f"{flag} = True" in shard, f"torch's fully_shard no longer sets {flag!r}: {where}"


def _binds_world_at_import(source: str) -> bool:
    """Whether a function in ``source`` has ``group.WORLD`` (``dist.group.WORLD``) as a default argument."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            if any(ast.unparse(d) in ("group.WORLD", "dist.group.WORLD") for d in defaults):
                return True
    return False


def test_every_torch_module_that_binds_the_default_group_at_import_is_unpinned() -> None:
    """patching.unpin_default_group covers the torch modules whose functions take ``group.WORLD`` as a default argument
    (evaluated at import): a new one in torch's source must be added to patching._PINNING_MODULES."""
    root = Path(torch.__file__).parent
    binding = {
        ".".join(("torch", *path.relative_to(root).with_suffix("").parts))
        for path in (root / "distributed").rglob("*.py")
        if "group.WORLD" in (text := path.read_text(encoding="utf-8", errors="replace"))
        and _binds_world_at_import(text)
    }
    assert binding, (
        "torch no longer binds group.WORLD as a default argument anywhere: re-check patching._PINNING_MODULES"
    )
    missing = sorted(binding - set(patching._PINNING_MODULES))
    assert not missing, (
        f"torch modules bind group.WORLD as a default argument and patching.unpin_default_group does not cover them: "
        f"{missing}; add them to engine/zero/comm/patching.py _PINNING_MODULES if None means the default group there"
    )


def test_unpin_puts_none_back_where_a_late_import_bound_the_live_group(group: None) -> None:
    world = dist.group.WORLD
    saved = dist_nn_functional.broadcast.__defaults__
    dist_nn_functional.broadcast.__defaults__ = (world,)  # what importing the module after init_process_group binds
    try:
        assert patching.default_group_pinned()
        assert patching.unpin_default_group() == 1
        assert dist_nn_functional.broadcast.__defaults__ == (None,)
        assert not patching.default_group_pinned()
    finally:
        dist_nn_functional.broadcast.__defaults__ = saved
