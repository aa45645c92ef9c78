"""Batch-size arithmetic (``train = micro * accumulation * world``), the way DeepSpeed does it."""

from __future__ import annotations

import os

from elasticzero.errors import UsageError

__all__ = ["check_batch_sizes", "resolve_batch_sizes", "resolve_world_size"]


def resolve_world_size(world_size: int | None = None) -> int | None:
    """``world_size`` if given, else the running process group's size, else ``$WORLD_SIZE`` (torchrun), else None."""
    if world_size is not None:
        return world_size
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    env = os.environ.get("WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def resolve_batch_sizes(
    train: int | None, micro: int | None, accum: int | None, world: int | None, source: str
) -> tuple[int | None, int, int]:
    """Fill in the missing ones of (train, micro, accumulation) from the others, DeepSpeed's way.

    All three given: checked. ``train`` + one other: the third is derived (needs ``world``). ``micro`` and/or
    ``accum`` only: ``train`` follows when ``world`` is known. Nothing given: micro = accumulation = 1.
    """
    for name, value in (("train_batch_size", train), ("micro batch size", micro), ("accumulation steps", accum)):
        if value is not None and value < 1:
            raise UsageError(f"{source}: {name} must be >= 1, got {value}")
    if train is not None and (micro is None or accum is None):
        if world is None:
            raise UsageError(
                f"{source}: deriving the micro batch size / accumulation steps from train_batch_size={train} needs the "
                "world size: run under torchrun (WORLD_SIZE), pass world_size=, or give all three sizes"
            )
        if micro is None and accum is None:
            accum = 1
        if micro is None:
            assert accum is not None
            micro, rest = divmod(train, accum * world)
            if rest or micro < 1:
                raise UsageError(
                    f"{source}: train_batch_size={train} is not divisible by gradient_accumulation_steps={accum} "
                    f"x world size {world}"
                )
        else:
            accum, rest = divmod(train, micro * world)
            if rest or accum < 1:
                raise UsageError(
                    f"{source}: train_batch_size={train} is not divisible by train_micro_batch_size_per_gpu={micro} "
                    f"x world size {world}"
                )
    micro = 1 if micro is None else micro
    accum = 1 if accum is None else accum
    check_batch_sizes(train, micro, accum, world, source)
    if train is None and world is not None:
        train = micro * accum * world
    return train, micro, accum


def check_batch_sizes(train: int | None, micro: int, accum: int, world: int | None, source: str) -> None:
    """Raise :class:`UsageError` unless ``train == micro * accum * world`` (divisibility only when world is unknown)."""
    if train is None:
        return
    if world is not None and train != micro * accum * world:
        raise UsageError(
            f"{source}: contradictory batch sizes: train_batch_size={train} != micro batch {micro} x accumulation "
            f"{accum} x world size {world} = {micro * accum * world}"
        )
    if world is None and train % (micro * accum):
        raise UsageError(
            f"{source}: contradictory batch sizes: train_batch_size={train} is not a multiple of micro batch {micro} "
            f"x accumulation {accum}"
        )
