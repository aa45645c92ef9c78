"""How a snapshot stages tensors (``snapshot.staging_for``, fences) and where a load puts them, decided per device.

No GPU here: the CUDA decisions are checked on ``torch.device("cuda", n)`` objects (no CUDA call is made), the CPU
path is run for real, and the load side is checked on ``meta`` tensors (a device that is not the CPU and needs no
hardware): a template takes each tensor's device from the live state, and the fast reader hands every non-CPU
destination to torch's path, which reads to the CPU and copies into the destination.
"""

from __future__ import annotations

import torch

from elasticzero.checkpoint.reader import _fits
from elasticzero.checkpoint.snapshot import Stager, Staging, fences_after, fresh_like, staging_for
from elasticzero.engine.zero.layout import FlatChunk


def test_cuda_tensors_are_staged_pinned_and_asynchronous() -> None:
    assert staging_for(torch.device("cuda", 3)) == Staging(pinned=True, non_blocking=True)


def test_cpu_and_other_tensors_are_copied_plainly() -> None:
    for device in ("cpu", "meta"):
        assert staging_for(torch.device(device)) == Staging(pinned=False, non_blocking=False)


def test_no_fence_for_devices_other_than_cuda() -> None:
    assert fences_after([torch.device("cpu"), torch.device("meta"), torch.device("cpu")]) == ()


def test_cpu_state_is_staged_synchronously_into_pageable_buffers() -> None:
    live = {"w": torch.ones(4), "c": FlatChunk(torch.arange(3.0), 2, 5)}
    stager = Stager()
    snap = stager.stage(1, {"m": live})
    assert snap.fences == ()  # nothing to wait for: the copy finished inside stage()
    snap.wait_ready()
    staged = [snap.state["m"]["w"], snap.state["m"]["c"].tensor]
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in staged)
    live["w"].add_(1)
    assert torch.equal(snap.state["m"]["w"], torch.ones(4))
    assert stager.stage(2, {"m": live}).state["m"]["w"] is staged[0]  # same buffer reused


def test_load_template_is_on_the_live_tensors_device() -> None:
    live = {"w": torch.empty(3, device="meta"), "c": FlatChunk(torch.empty(2, device="meta"), 0, 2), "x": torch.ones(1)}
    template = fresh_like(live)
    assert template["w"].device.type == "meta" and template["c"].tensor.device.type == "meta"
    assert template["x"].device.type == "cpu"


def test_fast_reader_reads_only_into_cpu_destinations() -> None:
    """A destination on another device (CUDA on a GPU node) goes through torch's reader: it loads the item to the
    CPU and copies it into the destination, so a checkpoint written anywhere lands on the live parameter's device."""
    assert _fits(torch.empty(4), torch.float32, (4,))
    assert not _fits(torch.empty(4, device="meta"), torch.float32, (4,))
