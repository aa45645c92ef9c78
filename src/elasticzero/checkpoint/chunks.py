"""The one DCP extension elasticzero needs: an element range of a flattened tensor.

A ZeRO rank owns, of every parameter, at most one contiguous range of its flattened elements (its shard of the flat
bucket the parameter lives in). :class:`FlatChunk` puts such a range into a state dict: ``tensor`` holds elements
``[offset, offset + tensor.numel())`` of a 1-D tensor of ``numel`` elements. The planners in
:mod:`elasticzero.checkpoint.planner` turn it into a DCP ``SHARD`` write item (a chunk of a 1-D tensor at its global
offset) and, when loading, into read items for whatever saved chunks overlap it, so any saved partition maps onto any
new one. DTensor cannot say "elements 37..91" (its shards follow placements over a mesh), ShardedTensor is deprecated:
this is the plain description DCP's metadata already speaks (``ChunkStorageMetadata`` offsets and sizes).

This module imports nothing of elasticzero, so the engine can build chunks without depending on the checkpointer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FlatChunk:
    """Elements ``[offset, offset + tensor.numel())`` of a flattened tensor of ``numel`` elements (1-D ``tensor``)."""

    tensor: torch.Tensor
    offset: int
    numel: int

    def __post_init__(self) -> None:
        if self.tensor.dim() != 1 or not 0 <= self.offset <= self.offset + self.tensor.numel() <= self.numel:
            raise ValueError(
                f"FlatChunk: a 1-D tensor inside [0, {self.numel}) expected, got shape {tuple(self.tensor.shape)} "
                f"at offset {self.offset}"
            )

    def with_tensor(self, tensor: torch.Tensor) -> FlatChunk:
        """The same range over another tensor (a snapshot copy, a fresh load buffer)."""
        return FlatChunk(tensor, self.offset, self.numel)
