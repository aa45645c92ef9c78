"""Fault in a load's destination buffers on another core while the reading thread fills them.

A load into a process that never held the state (a restarted worker) reads into fresh buffers, and every page of
them faults on first touch, inside the reading ``preadv``: the kernel zeroes the page, then copies the file's bytes
over it. :class:`Prefaulter` runs ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14) over the destinations, in the
order the reader will fill them, in a thread (``ctypes`` releases the GIL for the call), so the faults happen beside
the reading rather than inside it. Contents are not changed: populating only maps the pages. Where the call is not
available (another system, an older kernel) the thread stops at the first refusal and the reader faults the pages
itself, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Callable, Sequence

import torch

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14


def page_range(address: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: ``(start, length)``, length 0 if there is none (the
    partial pages at the ends are left to the reader)."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


class Prefaulter:
    """``with Prefaulter(tensors):`` populates ``tensors`` (the contiguous CPU ones, in that order) writable in a
    background thread; the block's exit waits for it (quick: pages already present are only walked)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._ranges = [
            page_range(t.data_ptr(), t.numel() * t.element_size())
            for t in tensors
            if t.device.type == "cpu" and t.is_contiguous()
        ]
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # set when the block exits early (an error): the rest is not needed
        self.populated = 0  # bytes populated (tests, diagnostics)

    def __enter__(self) -> Prefaulter:
        madvise = _madvise()
        if madvise is not None and self._ranges:
            self._thread = threading.Thread(target=self._run, args=(madvise,), name="elasticzero-prefault", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, madvise: Callable[[int, int, int], int]) -> None:
        for start, length in self._ranges:
            if self._stop.is_set():
                return
            if length and madvise(start, length, MADV_POPULATE_WRITE) != 0:
                return  # EINVAL: a kernel without it; the reader faults the pages itself
            self.populated += length


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
