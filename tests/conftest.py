"""Root pytest configuration: see ``ez_testing`` for the shared helpers and the real-part rule."""

from __future__ import annotations

import os

# Tests run many small torch processes on 2 cores: keep each one single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
