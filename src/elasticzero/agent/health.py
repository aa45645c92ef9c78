"""The agent's health/ready file (``--health-file PATH``): JSON rewritten atomically on every state change.

``{"state": "running", "agent_pid": …, "worker_pids": […], "ranks": […], "group_rank": …, "group_world_size": …,
"world_size": …, "restart_count": …, "time": …}`` while workers run; ``"state": "stopped"`` while they are
down (failure, restart, re-rendezvous); removed when the agent exits. A probe can treat "file exists and state is
running" as ready.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from elasticzero.fileio import write_atomic


class HealthFile:
    """Writes the health file; every method is a no-op when no path was given."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None

    def write(self, state: str, **fields: Any) -> None:
        """Atomically replace the file with ``{"state": state, "agent_pid": …, "time": …, **fields}``."""
        if self.path is None:
            return
        data = {"state": state, "agent_pid": os.getpid(), "time": time.time(), **fields}
        write_atomic(self.path, json.dumps(data), durable=False)  # a status file: atomic, no fsync per update

    def remove(self) -> None:
        """Delete the file (agent exit)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read_health(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The health file's content, or ``None`` when it does not exist (yet) or is being replaced."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
