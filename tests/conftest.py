"""Root pytest configuration: see ``ez_testing`` for the shared helpers and the real-part rule."""

from __future__ import annotations

import os

# Tests run many small torch processes on 2 cores: keep each one single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionstart(session: object) -> None:
    """Under ``ATEN_CPU_CAPABILITY`` (tests/run.sh runs the numerical tests once per CPU kernel set), stop unless torch
    really uses the requested kernels: for one this CPU lacks it silently falls back to its best."""
    requested = os.environ.get("ATEN_CPU_CAPABILITY")
    if not requested:
        return
    import pytest
    import torch

    used = torch.backends.cpu.get_cpu_capability()
    if used.lower() != requested.lower():
        raise pytest.UsageError(
            f"ATEN_CPU_CAPABILITY={requested}: torch uses {used} kernels (it offers no {requested} on this CPU); "
            "unset it or choose one torch reports back"
        )
