"""A DCP storage reader that reads tensor bytes straight from ``.distcp`` files into the destination tensors.

torch's ``FileSystemReader.read_data`` ``torch.load``\\ s every item (zip parsing through a Python file view, the
weights-only unpickler, a fresh storage), then narrows and ``copy_``\\ s it into the tensor the planner resolved: per
item a few hundred microseconds of Python plus two copies of the bytes. Each item DCP writes (``FileSystemWriter``,
torch-save format) is one uncompressed zip archive inside the ``.distcp`` file: the records are stored (method 0),
64-byte aligned, and a tensor's bytes are the ``data/<key>`` record. :class:`FastFileSystemReader` opens each file
once, walks the requests in file order, parses each item's zip central directory and its ``data.pkl`` (a pickle
restricted to what ``torch.save`` of one plain tensor pickles, mapped to recorders: nothing is imported or called), and
``os.preadv``\\ s the requested byte range into the destination tensor's memory — one copy, the GIL released.

An item this cannot do exactly as torch would (a transform, a destination that is not contiguous or of another
dtype, a narrow that is not one contiguous byte range, a non-little-endian record, a pickle with any other name)
goes to torch's own ``read_data`` unchanged. A file that is not what its metadata says (short, bad zip headers, a
record of another size) raises :class:`~elasticzero.errors.UsageError` naming the file.

Public DCP extension point: ``StorageReader.read_data(plan, planner)`` with ``planner.resolve_tensor`` /
``commit_tensor`` / ``load_bytes``.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import io
import math
import os
import pickle
import struct
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from elasticzero.checkpoint.planner import SafeFileSystemReader
from elasticzero.checkpoint.prefault import Prefaulter
from elasticzero.errors import UsageError

_HEAD = 4096  # bytes read at an item's start (data.pkl, byteorder and the data record's local header fit in it)
_TAIL = 4096  # bytes read at an item's end (the central directory of a tensor item fits in it)
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory, 22 bytes
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
_LOCATOR64 = struct.Struct("<4sIQI")  # zip64 end of central directory locator, 20 bytes
_STORAGE_DTYPES = {
    f"{name}Storage": dtype
    for name, dtype in {
        "Float": torch.float32,
        "Double": torch.float64,
        "Half": torch.float16,
        "BFloat16": torch.bfloat16,
        "Long": torch.int64,
        "Int": torch.int32,
        "Short": torch.int16,
        "Char": torch.int8,
        "Byte": torch.uint8,
        "Bool": torch.bool,
        "ComplexFloat": torch.complex64,
        "ComplexDouble": torch.complex128,
    }.items()
}


class BadItem(Exception):
    """The bytes of an item are not a torch-save zip as DCP writes it (the caller names the file)."""


class Unsupported(Exception):
    """A valid item this reader does not read itself (torch's path reads it)."""


# -- pure: the zip records of one item --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Record:
    name: str
    method: int
    size: int  # uncompressed
    compressed: int
    header: int  # offset of the local header inside the item


def central_directory(tail: bytes, item_length: int) -> tuple[int, int]:
    """``(offset, size)`` of the central directory inside an item whose last ``len(tail)`` bytes are ``tail``."""
    if len(tail) < _EOCD.size or tail[-_EOCD.size : -_EOCD.size + 4] != b"PK\x05\x06":
        raise BadItem("no zip end-of-central-directory record at the item's end")
    _, _, _, _, _, cd_size, cd_offset, comment = _EOCD.unpack(tail[-_EOCD.size :])
    if comment:
        raise BadItem("zip comment after the central directory")
    if cd_offset != 0xFFFFFFFF and cd_size != 0xFFFFFFFF:
        return cd_offset, cd_size
    loc = tail[-_EOCD.size - _LOCATOR64.size : -_EOCD.size]
    if len(loc) != _LOCATOR64.size or loc[:4] != b"PK\x06\x07":
        raise BadItem("zip64 locator missing")
    eocd64_at = _LOCATOR64.unpack(loc)[2] - (item_length - len(tail))
    rec = tail[eocd64_at : eocd64_at + _EOCD64.size] if eocd64_at >= 0 else b""
    if len(rec) != _EOCD64.size or rec[:4] != b"PK\x06\x06":
        raise BadItem("zip64 end-of-central-directory record missing")
    fields = _EOCD64.unpack(rec)
    return fields[9], fields[8]


def parse_central_directory(cd: bytes) -> dict[str, Record]:
    """``{name: Record}`` of a central directory's entries."""
    out, at = {}, 0
    while at < len(cd):
        if len(cd) - at < _CENTRAL.size or cd[at : at + 4] != b"PK\x01\x02":
            raise BadItem("bad zip central directory entry")
        f = _CENTRAL.unpack_from(cd, at)
        method, compressed, size, nlen, xlen, clen, header = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        name = cd[at + _CENTRAL.size : at + _CENTRAL.size + nlen].decode("utf-8", "replace")
        extra = cd[at + _CENTRAL.size + nlen : at + _CENTRAL.size + nlen + xlen]
        size, compressed, header = _zip64_fields(extra, size, compressed, header)
        out[name] = Record(name, method, size, compressed, header)
        at += _CENTRAL.size + nlen + xlen + clen
    return out


def _zip64_fields(extra: bytes, size: int, compressed: int, header: int) -> tuple[int, int, int]:
    values = [size, compressed, header]
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            wide = iter(struct.unpack_from(f"<{n // 8}Q", extra, at + 4))
            values = [next(wide) if v == 0xFFFFFFFF else v for v in values]
        at += 4 + n
    return values[0], values[1], values[2]


def data_offset(local_header: bytes, record: Record) -> int:
    """Where ``record``'s bytes start inside the item, from its local header (``local_header`` starts there)."""
    if len(local_header) < _LOCAL.size or local_header[:4] != b"PK\x03\x04":
        raise BadItem(f"bad zip local header of {record.name}")
    nlen, xlen = _LOCAL.unpack_from(local_header)[9:11]
    if local_header[_LOCAL.size : _LOCAL.size + nlen] != record.name.encode():
        raise BadItem(f"zip local header of {record.name} names another record")
    return record.header + _LOCAL.size + nlen + xlen


# -- pure: what data.pkl says about the tensor ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PickledTensor:
    key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any) -> PickledTensor:
    if not isinstance(storage, tuple) or not all(isinstance(v, int) for v in (storage_offset, *size, *stride)):
        raise Unsupported("unexpected tensor arguments")
    return PickledTensor(storage[0], storage[1], storage[2], storage_offset, tuple(size), tuple(stride))


_NAMES = {("torch._utils", "_rebuild_tensor_v2"): _rebuild, ("collections", "OrderedDict"): collections.OrderedDict}


class _TensorUnpickler(pickle.Unpickler):
    """Admits only what ``torch.save`` of one plain tensor pickles; returns a :class:`PickledTensor`, no tensor."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NAMES:
            return _NAMES[module, name]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise Unsupported("unexpected persistent id")
        if not isinstance(pid[2], str) or not isinstance(pid[4], int):
            raise Unsupported("unexpected storage key")
        return (pid[2], pid[1].dtype, pid[4])


def pickled_tensor(data_pkl: bytes) -> PickledTensor:
    """The tensor ``data.pkl`` describes; :class:`Unsupported` for anything but one plain tensor."""
    try:
        obj = _TensorUnpickler(io.BytesIO(data_pkl)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, AttributeError) as exc:
        raise Unsupported(f"data.pkl: {exc}") from exc
    if not isinstance(obj, PickledTensor):
        raise Unsupported("data.pkl is not a tensor")
    return obj


def byte_range(t: PickledTensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int]:
    """``(start, nbytes)`` inside the storage record of ``t`` narrowed to ``offsets``/``lengths`` (DCP's
    ``narrow_tensor_by_index``), when that is one contiguous byte range of a contiguous tensor."""
    dims = len(t.size)
    if len(offsets) != dims or len(lengths) != dims:
        raise Unsupported("narrow of another rank")
    if any(st != math.prod(t.size[d + 1 :]) for d, st in enumerate(t.stride) if t.size[d] > 1):
        raise Unsupported("saved tensor is not contiguous")
    if any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, t.size, strict=True)):
        raise BadItem(f"request {offsets}+{lengths} outside the saved tensor {t.size}")
    if any(offsets[d] != 0 or lengths[d] != t.size[d] for d in range(1, dims)):
        raise Unsupported("narrow is not one contiguous range")
    row = math.prod(t.size[1:]) if dims else 1
    first = t.storage_offset + (offsets[0] * row if dims else 0)
    count = math.prod(lengths)
    if first + count > t.storage_numel:
        raise BadItem(
            f"tensor of {t.storage_offset}+{math.prod(t.size)} elements in a {t.storage_numel}-element storage"
        )
    return first * t.dtype.itemsize, count * t.dtype.itemsize


# -- I/O ----------------------------------------------------------------------------------------------------------
class _Item:
    """One DCP item (``offset``, ``length`` in its file) read through ``fd``: head and tail cached."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length = fd, offset, length
        self.head = _pread(fd, min(_HEAD, length), offset)

    def bytes(self, at: int, n: int) -> bytes:
        if at + n <= len(self.head):
            return self.head[at : at + n]
        if at + n > self.length:
            raise BadItem(f"zip record at {at} runs past the item's {self.length} bytes")
        return _pread(self.fd, n, self.offset + at)

    def records(self) -> dict[str, Record]:
        tail_len = min(_TAIL, self.length)
        tail = _pread(self.fd, tail_len, self.offset + self.length - tail_len)
        cd_at, cd_size = central_directory(tail, self.length)
        if not 0 <= cd_at <= cd_at + cd_size <= self.length:
            raise BadItem("zip central directory outside the item")
        return parse_central_directory(self.bytes(cd_at, cd_size))

    def record(self, rec: Record) -> tuple[int, int]:
        """``(offset in the item, size)`` of a stored record's bytes."""
        if rec.method != 0 or rec.compressed != rec.size:
            raise BadItem(f"zip record {rec.name} is compressed (method {rec.method})")
        at = data_offset(self.bytes(rec.header, _LOCAL.size + len(rec.name.encode())), rec)
        if at + rec.size > self.length:
            raise BadItem(f"zip record {rec.name} runs past the item's end")
        return at, rec.size


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise BadItem(f"{n} bytes wanted at {offset}, the file ends after {len(data)}")
    return data


def preadv_into(fd: int, dest: torch.Tensor, offset: int) -> None:
    """Fill contiguous CPU ``dest`` with the file's bytes at ``offset`` (short read: :class:`BadItem`)."""
    nbytes = dest.numel() * dest.element_size()
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(dest.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise BadItem(f"{nbytes} bytes wanted at {offset}, the file ends after {done}")
        done += n


class FastFileSystemReader(SafeFileSystemReader):
    """:class:`~elasticzero.checkpoint.planner.SafeFileSystemReader` whose ``read_data`` reads tensor items into
    their destination with one ``preadv`` each (see the module docstring); other items go through torch's path."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in sorted(plan.items, key=lambda r: self.storage_data[r.storage_index].offset):
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        self._read_ahead(per_file)
        dests = {
            id(r): planner.resolve_tensor(r).detach() for reqs in per_file.values() for r in reqs if self._direct(r)
        }
        slow: list[ReadItem] = []
        with Prefaulter(list(dests.values())):  # the destinations' pages fault on another core, in reading order
            for relative_path, reqs in per_file.items():
                path = os.path.join(str(self.path), relative_path)
                try:
                    slow += self._read_file(path, reqs, planner, dests)
                except BadItem as exc:
                    raise UsageError(f"{path}: not a DCP data file as its metadata says ({exc})") from exc
                except OSError as exc:
                    raise UsageError(f"{path}: could not be read ({exc})") from exc
        self.slow_items = len(slow)  # read by torch's path (tests, diagnostics)
        if slow:
            super().read_data(dataclasses.replace(plan, items=slow), planner).wait()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _direct(self, req: ReadItem) -> bool:
        """Whether ``req`` may be read straight into its destination (a tensor item without transforms)."""
        return req.type != LoadItemType.BYTE_IO and not self.storage_data[req.storage_index].transform_descriptors

    def _read_ahead(self, per_file: dict[str, list[ReadItem]]) -> None:
        """Ask the kernel to start reading every byte range this plan needs (``POSIX_FADV_WILLNEED``), so a file
        not yet in the page cache (a node that did not write it) streams in while items are parsed and copied."""
        if not hasattr(os, "posix_fadvise"):
            return
        for relative_path, reqs in per_file.items():
            infos = [self.storage_data[r.storage_index] for r in reqs]
            lo, hi = min(i.offset for i in infos), max(i.offset + i.length for i in infos)
            try:
                fd = os.open(os.path.join(str(self.path), relative_path), os.O_RDONLY)
            except OSError:
                continue  # reported by the read itself
            try:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # advice only
            finally:
                os.close(fd)

    def _read_file(
        self, path: str, reqs: list[ReadItem], planner: LoadPlanner, dests: dict[int, torch.Tensor]
    ) -> list[ReadItem]:
        """Read ``reqs`` (in file order) from ``path``; ``dests``: the resolved destination of each direct request."""
        slow = []
        fd = os.open(path, os.O_RDONLY)
        try:
            parsed: dict[Any, tuple[PickledTensor, int, int] | None] = {}
            for req in reqs:
                info, dest = self.storage_data[req.storage_index], dests.get(id(req))
                if dest is not None:  # a direct item (see _direct)
                    if not self._read_tensor(fd, info, req, planner, parsed, dest):
                        slow.append(req)
                elif info.transform_descriptors:
                    slow.append(req)
                else:
                    planner.load_bytes(req, io.BytesIO(_pread(fd, info.length, info.offset)))
        finally:
            os.close(fd)
        return slow

    def _read_tensor(
        self, fd: int, info: Any, req: ReadItem, planner: LoadPlanner, parsed: dict, dest: torch.Tensor
    ) -> bool:
        key = req.storage_index
        if key not in parsed:
            try:
                parsed[key] = locate_tensor(_Item(fd, info.offset, info.length))
            except Unsupported:
                parsed[key] = None
        if parsed[key] is None:
            return False
        t, at, size = parsed[key]
        try:
            start, nbytes = byte_range(t, tuple(req.storage_offsets), tuple(req.lengths))
        except Unsupported:
            return False
        if start + nbytes > size:
            raise BadItem(f"tensor bytes {start}+{nbytes} outside its {size}-byte record")
        if not _fits(dest, t.dtype, tuple(req.lengths)):
            return False
        preadv_into(fd, dest, info.offset + at + start)
        planner.commit_tensor(req, dest)
        return True


def locate_tensor(item: _Item) -> tuple[PickledTensor, int, int]:
    """The tensor an item holds and ``(offset in the item, size)`` of its storage record."""
    records = item.records()
    prefix = next((n[: -len("data.pkl")] for n in records if n.endswith("/data.pkl")), None)
    if prefix is None:
        raise BadItem("no data.pkl record")
    order = records.get(prefix + "byteorder")
    if order is None or item.bytes(*item.record(order)) != b"little":
        raise Unsupported("not little-endian")
    t = pickled_tensor(item.bytes(*item.record(records[prefix + "data.pkl"])))
    rec = records.get(f"{prefix}data/{t.key}")
    if rec is None:
        raise BadItem(f"no record for storage {t.key!r}")
    at, size = item.record(rec)
    if size != t.storage_numel * t.dtype.itemsize:
        raise BadItem(f"storage record of {size} bytes, {t.storage_numel} x {t.dtype.itemsize} expected")
    return t, at, size


def _fits(dest: torch.Tensor, dtype: torch.dtype, lengths: tuple[int, ...]) -> bool:
    return (
        dest.device.type == "cpu"
        and dest.dtype == dtype
        and tuple(dest.shape) == lengths
        and dest.is_contiguous()
        and not dest.is_conj()
        and not dest.is_neg()
    )
