"""The append-only journal of a tuning run: one JSON object per line, each line fsynced before the tuner goes on.

Records::

    {"event": "start",  "key": K, "name": N, "job_id": J, "hosts": [...], "time": T}
    {"event": "finish", "key": K, "name": N, "outcome": {...}, "time": T}

:func:`replay` folds the lines into a :class:`JournalState` (pure): the finished experiments with their outcomes, and
the ones that started but never finished (the tuner was killed while they ran): those are run again, after their
leftover processes are killed by job id. A torn last line (the tuner died mid-write) is ignored; a malformed line
before the end is an error naming the line. Resume is the default; ``--fresh`` moves the journal aside
(``journal-<time>.jsonl``) and starts a new one — earlier results are never deleted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticzero.errors import UsageError

__all__ = ["Journal", "JournalState", "replay"]


@dataclass
class JournalState:
    """What the journal says: finished outcomes by key, and the starts without a finish."""

    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    interrupted: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> its start record
    order: list[str] = field(default_factory=list)  # keys in finishing order


def replay(lines: Iterable[str], source: str = "journal") -> JournalState:
    """Fold journal lines into a :class:`JournalState`."""
    state = JournalState()
    texts = [t for t in lines if t.strip()]
    for number, text in enumerate(texts, start=1):
        try:
            record = json.loads(text)
        except ValueError:
            if number == len(texts):
                break  # torn final write: the tuner died while appending it
            raise UsageError(f"{source}:{number}: not a JSON line; move the journal aside or use --fresh") from None
        _apply(state, record, f"{source}:{number}")
    return state


def _apply(state: JournalState, record: Mapping[str, Any], where: str) -> None:
    event, key = record.get("event"), record.get("key")
    if not isinstance(key, str):
        raise UsageError(f"{where}: record without a key; move the journal aside or run with --fresh")
    if event == "start":
        state.interrupted[key] = dict(record)
    elif event == "finish":
        state.interrupted.pop(key, None)
        if key not in state.finished:
            state.order.append(key)
        state.finished[key] = dict(record.get("outcome") or {})
    else:
        raise UsageError(f"{where}: unknown event {event!r}; move the journal aside or run with --fresh")


class Journal:
    """Appends records to ``path`` durably (``O_APPEND``, flush, ``fsync`` per record)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> JournalState:
        if not self.path.exists():
            return JournalState()
        text = self.path.read_text()
        if text and not text.endswith("\n"):  # a torn final write: cut it so the next record starts a line
            keep = text.rfind("\n") + 1
            os.truncate(self.path, len(text[:keep].encode()))
            text = text[:keep]
        return replay(text.splitlines(), str(self.path))

    def start_fresh(self) -> Path | None:
        """Move an existing journal aside (never delete it); returns where it went."""
        if not self.path.exists():
            return None
        aside = self.path.with_name(f"{self.path.stem}-{time.strftime('%Y%m%d%H%M%S')}{self.path.suffix}")
        os.replace(self.path, aside)
        return aside

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps({**record, "time": round(time.time(), 3)}, sort_keys=True, default=str) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
