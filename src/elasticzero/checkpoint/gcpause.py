"""Automatic garbage collection paused while a checkpoint is planned, written or read.

DCP plans every save and load by pickling and unpickling one plan object per item on every rank (thousands of small
objects for a ZeRO state). Those bursts of allocations make CPython's cyclic collector run, and its full collections
walk every object of the process with the GIL held: profiled at 0.17 s of a 0.6 s load of the 29.5M-parameter GPT
at world size 1 (``bench/checkpoint_bench.py``), and during an async save, time the training thread waits for the
GIL. torch pauses the collector the same way around its own state-dict work (``_gc_context`` in
``torch.distributed.checkpoint.state_dict``) and in its background checkpoint process.

The collector is process-wide, so is the pause: nested and overlapping pauses (a load, a background save) count,
and automatic collection resumes when the last one ends if it was enabled when the first began. Nothing is forced
or leaked: objects that became garbage meanwhile are collected by the next automatic collection.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator


class GcPause:
    """A counted pause of automatic garbage collection (:meth:`enter` / :meth:`leave`, from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._resume = False

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._depth += 1

    def leave(self) -> None:
        with self._lock:
            if self._depth == 0:
                raise RuntimeError("GcPause.leave() without enter()")
            self._depth -= 1
            if self._depth == 0 and self._resume:
                gc.enable()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()


PAUSE = GcPause()
"""The process's one pause (the collector it pauses is process-wide)."""


def gc_paused() -> contextlib.AbstractContextManager[None]:
    """``with gc_paused(): ...`` — automatic garbage collection off inside (see the module docstring)."""
    return PAUSE()
