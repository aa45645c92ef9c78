"""Fencing of a checkpoint directory: only the newest world writes into it.

A world (the ranks of one process group, i.e. one rendezvous round of an elastic job) *claims* the directory when
its :class:`~elasticzero.checkpoint.Checkpointer` is built: rank 0 writes a fresh token into ``DIR/writer``
(atomically) and every rank learns it. Before each rank writes its files, before rank 0 commits, and before it deletes
old checkpoints, the rank compares the file's token with its own world's (:func:`check`); a different one means a newer
world formed (this node was declared gone — frozen or cut off — and resumed later): the write raises
:class:`FencedError` and nothing more of the stale world reaches the directory, so there is never a second rank 0
committing. The check and the rename are two steps: a rank frozen between them (microseconds) is not fenced — the
window a token in a store compared at commit also leaves; see docs/checkpointing.md, "Fencing".

A Checkpointer built with ``read_only=True`` (a tool or loader beside a job) claims nothing — the job writing there is
not fenced off by it — and refuses to save (:func:`read_only_message`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

from elasticzero.fileio import write_atomic

WRITER = "writer"
logger = logging.getLogger(__name__)


class FencedError(RuntimeError):
    """A newer world owns the checkpoint directory: this (stale) world must not write into it."""


def fenced_message(root: Path, what: str, step: int, mine: str, current: str | None) -> str | None:
    """Why ``what`` of ``step`` is refused (``None``: this world still owns ``root``) — a pure decision."""
    if current == mine:
        return None
    owner = "no world (the writer file is gone)" if current is None else f"a newer world (token {current})"
    return (
        f"{root}: {what} of step {step} refused: the checkpoint directory belongs to {owner}, not to this one "
        f"(token {mine}); this node was declared gone (frozen or cut off) and the job went on without it"
    )


def read_only_message(root: Path, step: int) -> str:
    """Why a read-only Checkpointer's save of ``step`` is refused."""
    return (
        f"{root}: save of step {step} refused: this Checkpointer is read-only (read_only=True: it loads and does not "
        "claim the directory, so a job writing there keeps it); build one without read_only=True to save"
    )


def claim(root: Path) -> str:
    """Make a fresh token the directory's writer (rank 0 of a new world); returns it."""
    token = os.urandom(8).hex()
    record = {"token": token, "host": socket.gethostname(), "pid": os.getpid()}
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / WRITER, (json.dumps(record) + "\n").encode())
    return token


def current(root: Path) -> str | None:
    """The token of the world that owns ``root`` (``None``: none has claimed it, or the file is unreadable)."""
    try:
        token = json.loads((root / WRITER).read_text()).get("token")
    except (OSError, ValueError, AttributeError):
        return None
    return token if isinstance(token, str) else None


def check(root: Path, what: str, step: int, mine: str) -> None:
    """Raise :class:`FencedError` unless the world with token ``mine`` still owns ``root``."""
    message = fenced_message(root, what, step, mine, current(root))
    if message is not None:
        logger.error(message)  # at once: the stale process may hang in its teardown before its traceback prints
        raise FencedError(message)
