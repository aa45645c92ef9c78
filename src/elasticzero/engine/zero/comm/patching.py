"""The one effect of the engine on the process outside its communicators: torch functions that bind the default
group into their default arguments at import (:func:`unpin_default_group`, :func:`default_group_pinned`)."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  (see below: imported before the script initialises the group)

# torch.distributed.nn.functional binds ``group.WORLD`` into its functions' default arguments when it is imported. It
# is imported by torch._dynamo, i.e. by the first torch.optim optimizer a script builds (or by transformers): after
# init_process_group, that pins the default group, so destroy_process_group() no longer joins gloo's threads, and a
# thread still letting go of the last collective's tensors while the interpreter finalizes aborts the process (see
# Communicator.settle). Imported here, with the engine, before the script initialises the group, the defaults bind
# None; when the script initialised the group first, unpin_default_group() puts None back (what the defaults would
# have been).

# modules of torch whose functions bind ``dist.group.WORLD`` as a default argument at import (checked against torch's
# source by tests/unit/engine/test_behaviour_canaries.py); None means "the default group at call time" in all of them
_PINNING_MODULES = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)


def _pinning_functions() -> list[Any]:
    """Functions (and ``__init__`` s) of the already imported pinning modules."""
    found = []
    for name in _PINNING_MODULES:
        module = sys.modules.get(name)
        for obj in vars(module).values() if module is not None else ():
            if isinstance(obj, type) and obj.__module__ == name:
                obj = obj.__dict__.get("__init__")
            if inspect.isfunction(obj) and obj.__module__ == name:
                found.append(obj)
    return found


def default_group_pinned() -> bool:
    """Whether a torch function's default argument holds the live default group (its module imported after init)."""
    world = dist.group.WORLD
    return world is not None and any(
        d is world for f in _pinning_functions() for d in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())
    )


def unpin_default_group() -> int:
    """Replace default arguments that hold the live default group with None (the value they have when their module is
    imported before ``init_process_group``; every such function resolves None to the default group when called), so
    ``destroy_process_group()`` can free the group and join its threads. Returns how many defaults were replaced.

    Called by the engine in one place: :class:`Communicator` opened on the default group (see there)."""
    world, replaced = dist.group.WORLD, 0
    if world is None:
        return 0
    for f in _pinning_functions():
        if any(d is world for d in f.__defaults__ or ()):
            replaced += sum(d is world for d in f.__defaults__)
            f.__defaults__ = tuple(None if d is world else d for d in f.__defaults__)
        if any(d is world for d in (f.__kwdefaults__ or {}).values()):
            replaced += sum(d is world for d in f.__kwdefaults__.values())
            f.__kwdefaults__ = {k: None if d is world else d for k, d in f.__kwdefaults__.items()}
    return replaced
