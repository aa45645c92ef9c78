"""``RNGState``: every rank's random number generators in the checkpoint, restored where that still means something.

Dropout masks and other random draws come from per-rank generators: torch's CPU generator, the current accelerator's
(CUDA) generators and Python's ``random``. Resumed at the same world size, each rank continues its own streams exactly
(bit-identical dropout after a restart). At another world size per-rank streams do not map onto the new ranks (which
rank's stream should the third of three ranks continue?), so the generators are left as the script seeded them and
:attr:`RNGState.restored` says so — the data order does not depend on them (it is the sampler's state).

The state is plain values gathered from every rank at ``state_dict()``: one JSON document per rank, as bytes, in one
list — a single DCP entry whatever the world size (a list of dicts would be flattened into per-rank keys, and a
template at another world size would not match them). DCP stores it once; loading it unpickles nothing but plain
values (``weights_only``). ``state_dict()`` is collective over ``process_group`` (call it on every rank, as
``Checkpointer.save`` does).
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch
import torch.distributed as dist

from elasticzero.errors import UsageError

STATE_VERSION = 1


def local_state() -> dict[str, Any]:
    """This process's generator states as plain values."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": bytes(torch.get_rng_state().numpy()),
        "random": [int(version), [int(x) for x in internal], gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_local(state: dict[str, Any]) -> None:
    """Set this process's generators from :func:`local_state`'s values (checked first: all or nothing)."""
    cuda = state.get("cuda") if torch.cuda.is_available() else None
    if cuda is not None and len(cuda) != torch.cuda.device_count():
        raise UsageError(
            f"RNGState: the checkpoint has {len(cuda)} CUDA generators per rank, this process sees "
            f"{torch.cuda.device_count()} devices: resume with the same devices per rank"
        )
    version, internal, gauss = state["random"]
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if cuda is not None:
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in cuda])


def encode(state: dict[str, Any]) -> bytes:
    """One rank's :func:`local_state` as a JSON document (bytes hex-encoded)."""
    doc = {**state, "torch": state["torch"].hex()}
    if "cuda" in state:
        doc["cuda"] = [s.hex() for s in state["cuda"]]
    return json.dumps(doc).encode()


def decode(blob: bytes) -> dict[str, Any]:
    """:func:`encode`'s inverse."""
    doc = json.loads(blob)
    state = {**doc, "torch": bytes.fromhex(doc["torch"])}
    if "cuda" in doc:
        state["cuda"] = [bytes.fromhex(s) for s in doc["cuda"]]
    return state


class RNGState:
    """A ``Stateful`` for the checkpoint: ``state = {..., "rng": RNGState()}``.

    Args:
        process_group: the group whose ranks' generators are saved (default: the default group).
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self.restored: bool | None = None
        """After ``load_state_dict``: whether the generators were restored (False: saved at another world size)."""

    def state_dict(self) -> dict[str, Any]:
        world = dist.get_world_size(self.process_group)
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, encode(local_state()), group=self.process_group)
        return {"version": STATE_VERSION, "world_size": world, "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"RNGState: unknown state version {state.get('version')!r} (this build: {STATE_VERSION})")
        world = dist.get_world_size(self.process_group)
        self.restored = int(state["world_size"]) == world
        if self.restored:
            restore_local(decode(state["ranks"][dist.get_rank(self.process_group)]))
