"""Which collectives the communicator settles (``comm.settles``) and which take the ring, per backend and device.

Decided from the backend name and the tensor's device, so the NCCL cases need no GPU: gloo's worker threads release
a tensor after completing its work (the communicator waits for that), NCCL's work holds its tensors in C++ until its
end event and is never settled on the host; the ring is for CPU tensors over gloo only.
"""

from __future__ import annotations

import pytest

from elasticzero.engine.zero.comm.backends import ring_applies, settles


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", "cpu", True),
        ("gloo", "cuda", True),  # gloo's CUDA path runs on its own threads too
        ("nccl", "cuda", False),
        ("NCCL", "cuda", False),
        ("cpu:gloo,cuda:nccl", "cpu", True),
        ("cpu:gloo,cuda:nccl", "cuda", False),
    ],
)
def test_settles_only_what_gloo_serves(backend: str, device: str, expected: bool) -> None:
    assert settles(backend, device) is expected


def test_the_ring_is_never_used_over_nccl() -> None:
    assert not ring_applies("nccl", 8, None)
    assert ring_applies("gloo", 2, None) and not ring_applies("gloo", 2, "0") and not ring_applies("gloo", 1, None)
