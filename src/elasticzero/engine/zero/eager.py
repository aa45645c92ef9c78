"""The engine's module and autograd hooks run eagerly, outside every graph ``torch.compile`` traces.

FSDP2's rule (``torch.distributed.fsdp._fully_shard``: its pre/post-forward and pre-backward hooks are wrapped in
``torch._dynamo.disable``): a hook that gathers, frees, counts or records order is Python state, not tensor math.
Traced, Dynamo would bake that state into guards (a counter or flag that changes every step recompiles every step,
until the recompile limit drops the block to eager) and lower what it cannot (Inductor has no lowering for a storage
resize, which stage 3 gathers into). Wrapped here, Dynamo breaks the graph at the hook, runs it as plain Python, and
traces the module's forward around it: ``block.compile()`` and ``torch.compile(model)`` both compile only the math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])


def outside_graph(fn: F) -> F:
    """``fn`` (a hook) as a function ``torch.compile`` never traces into; it and all it calls run eagerly."""
    return torch.compiler.disable(fn, recursive=True)
