"""DCP planners that understand :class:`~elasticzero.engine.zero.layout.FlatChunk`, and a reader that unpickles
nothing but DCP's own metadata classes.

Public DCP extension points only: subclasses of ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` /
``FileSystemReader`` overriding their documented hooks (``create_local_plan``, ``lookup_object``,
``lookup_tensor``, ``load_bytes``, ``read_metadata``), items built from ``torch.distributed.checkpoint.planner`` /
``.metadata`` dataclasses and ``create_read_items_for_chunk_list`` (DCP's resharding algorithm).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from elasticzero.engine.zero.layout import FlatChunk
from elasticzero.errors import UsageError


def chunk_write_item(fqn: str, chunk: FlatChunk) -> WriteItem:
    """A DCP ``SHARD`` write item: ``chunk`` is a 1-D box of a ``(chunk.numel,)`` tensor."""
    box = ChunkStorageMetadata(offsets=torch.Size([chunk.offset]), sizes=torch.Size([chunk.tensor.numel()]))
    return WriteItem(
        index=MetadataIndex(fqn, box.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=box,
            properties=TensorProperties.create_from_tensor(chunk.tensor),
            size=torch.Size([chunk.numel]),
        ),
    )


def extract_chunks(tree: Any, path: str = "", found: dict[str, FlatChunk] | None = None) -> tuple[Any, dict]:
    """``tree`` with every :class:`FlatChunk` replaced by its tensor, and ``{fqn: chunk}`` (DCP's flattened names:
    dict keys joined with dots). DCP's planners only keep leaves they know (tensors, plain values), so the chunks
    travel beside the state dict."""
    found = {} if found is None else found
    if isinstance(tree, FlatChunk):
        found[path] = tree
        return tree.tensor, found
    if isinstance(tree, dict):
        return {k: extract_chunks(v, f"{path}.{k}" if path else str(k), found)[0] for k, v in tree.items()}, found
    return tree, found


def _split(state_dict: dict[str, Any], chunks: dict[str, FlatChunk]) -> dict[str, Any]:
    return {k: v for k, v in state_dict.items() if k not in chunks}


class ZeroSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` plus :class:`FlatChunk` leaves (written as chunks of a 1-D tensor at their offset).

    Plain tensors and other values are planned as DCP does (replicated entries are deduplicated across ranks)."""

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        state_dict, self.chunks = extract_chunks(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        chunks = self.chunks
        plan = create_default_local_save_plan(_split(self.state_dict, chunks), self.is_coordinator)
        items = plan.items + [chunk_write_item(k, c) for k, c in chunks.items() if c.tensor.numel() > 0]
        plan = dataclasses.replace(plan, items=items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.chunks:
            return self.chunks[index.fqn].tensor
        return super().lookup_object(index)


class ZeroLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` plus :class:`FlatChunk` leaves (read from every saved chunk overlapping their range);
    non-tensor values are unpickled with ``torch.load(weights_only=True)`` (plain Python values only)."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.template = state_dict  # non-tensor values are set here (tensors are filled in place)
        state_dict, self.chunks = extract_chunks(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        errors = template_errors({**self.state_dict, **self.chunks}, self.metadata)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise UsageError(f"checkpoint does not fit this state (another model?): {errors[0]}{more}")
        chunks = self.chunks
        rest = _split(self.state_dict, chunks)
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, c in chunks.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (c.numel,):
                raise UsageError(f"checkpoint entry {fqn!r} is missing or not a 1-D tensor of {c.numel} elements")
            box = ChunkStorageMetadata(offsets=torch.Size([c.offset]), sizes=torch.Size([c.tensor.numel()]))
            if c.tensor.numel() > 0:
                items += create_read_items_for_chunk_list(fqn, md, [box])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.chunks:
            return self.chunks[index.fqn].tensor  # read items' dest_offsets are relative to the local chunk
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UsageError(f"checkpoint entry {fqn!r} is not a plain value: {exc}") from exc
        *parents, last = self.mappings[fqn] if self.flatten_state_dict else (fqn,)
        node = self.template
        for key in parents:
            node = node[key]
        node[last] = obj


# what DCP pickles into .metadata (torch 2.x); anything else is refused instead of imported
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to import {module}.{name}")


def read_metadata_file(path: str) -> Metadata:
    """DCP's ``.metadata`` at ``path``, unpickled with only DCP's metadata classes allowed (``UsageError`` if the file
    is unreadable, truncated or holds anything else)."""
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError) as exc:
        raise UsageError(f"{path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(md, Metadata):
        raise UsageError(f"{path}: not a DCP metadata file (holds {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` imports only DCP's metadata classes (torch's uses ``pickle.load``
    on the file); tensors are read by torch with ``weights_only=True`` already.

    ``metadata``: the checkpoint's ``.metadata`` when the caller has already read it with :func:`read_metadata_file`
    (it is not read and unpickled again)."""

    def __init__(self, path: str | os.PathLike[str], *, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        known = self._metadata if rank is None else None
        md = known if known is not None else read_metadata_file(str(self._get_metadata_path(rank)))
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


def template_errors(flat: dict[str, Any], metadata: Metadata) -> list[str]:
    """What in a flattened load template the checkpoint cannot fill: missing keys, tensors of other sizes."""
    errors = []
    for fqn, obj in flat.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            errors.append(f"{fqn!r} is not in the checkpoint")
            continue
        want = (obj.numel,) if isinstance(obj, FlatChunk) else tuple(obj.shape) if torch.is_tensor(obj) else None
        if want is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            errors.append(f"{fqn!r} is not a tensor in the checkpoint")
        elif tuple(md.size) != want:
            errors.append(f"{fqn!r} has shape {tuple(md.size)} in the checkpoint, {want} here")
    return errors
