"""The commit protocol of a checkpoint directory: pure decisions, then the few I/O steps that carry them out.

Layout of ``DIR``::

    step-00000100/            committed: DCP files (.metadata, __<rank>_<n>.distcp) + manifest.json
    step-00000200.tmp-<hex>/  being written (or left by a crash): never read
    step-00000050.del-<hex>/  being deleted (renamed away first, so a half-deleted directory never looks committed)
    latest                    name of the newest committed directory, for tools (replaced atomically)

The commit point is the rename ``step-N.tmp-<hex>`` → ``step-N``, done by one rank after every rank's files and the
manifest (size and checksum of every file) are written and fsynced; the directory is fsynced after it. So a crash or
SIGKILL of any rank at any moment leaves either no ``step-N`` or a complete one, and :func:`latest_step` never picks
a partial save. Older checkpoints are deleted (``keep_last``) only after the new one is committed and published.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticzero.checkpoint import digest
from elasticzero.errors import UsageError
from elasticzero.fileio import fsync_dir, write_atomic

FORMAT_VERSION = 2  # what this version writes: files checksummed with XXH3-64 (see digest.py)
READABLE_FORMATS = (1, 2)  # 1: the same layout with CRC-32s
MANIFEST = "manifest.json"
LATEST = "latest"
_COMMITTED = re.compile(r"^step-(\d{8,})$")
_ASIDE = re.compile(r"^step-(\d{8,})\.(tmp|del)-[0-9a-f]+$")


# -- pure decisions ---------------------------------------------------------------------------------------------------
def step_dir(step: int) -> str:
    """Name of the committed directory of ``step``."""
    if step < 0:
        raise UsageError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}"


def tmp_dir(step: int, token: str) -> str:
    """Name of the directory ``step`` is written into before its commit."""
    return f"{step_dir(step)}.tmp-{token}"


def new_token() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Listing:
    """What a checkpoint directory holds: committed steps and the names of set-aside directories."""

    committed: dict[int, str]
    aside: list[str]


def classify(entries: Iterable[tuple[str, bool]]) -> Listing:
    """``entries``: ``(name, has_manifest)`` of every sub-directory. A ``step-N`` without a manifest is not
    committed (it cannot be produced by this protocol; it is reported as set aside)."""
    committed: dict[int, str] = {}
    aside = []
    for name, has_manifest in entries:
        m = _COMMITTED.match(name)
        if m and has_manifest:
            committed[int(m.group(1))] = name
        elif m or _ASIDE.match(name):
            aside.append(name)
    return Listing(committed, sorted(aside))


def latest_step(listing: Listing) -> int | None:
    """The newest committed step (``None`` if there is none)."""
    return max(listing.committed, default=None)


def to_delete(listing: Listing, keep_last: int, just_committed: int) -> list[str]:
    """Committed directories beyond the newest ``keep_last`` (the one just committed is always kept), and directories
    set aside by crashed saves or deletions (only one save is in flight, and it is the caller's)."""
    if keep_last < 1:
        raise UsageError(f"keep_last must be >= 1, got {keep_last}")
    keep = set(sorted(listing.committed, reverse=True)[:keep_last]) | {just_committed}
    old = [name for step, name in sorted(listing.committed.items()) if step not in keep]
    return old + list(listing.aside)


def manifest_errors(manifest: Any, where: str) -> list[str]:
    """What is wrong with a parsed manifest (empty if it is usable)."""
    if not isinstance(manifest, Mapping):
        return [f"{where}: not a JSON object"]
    if manifest.get("format") not in READABLE_FORMATS:
        readable = ", ".join(map(str, READABLE_FORMATS))
        return [f"{where}: unknown checkpoint format {manifest.get('format')!r} (this version reads {readable})"]
    files = manifest.get("files")
    if not isinstance(files, Mapping) or not files:
        return [f"{where}: no file list"]
    errors = []
    for key in ("step", "world_size"):
        if not isinstance(manifest.get(key), int):
            errors.append(f"{where}: {key!r} missing or not an integer")
    return errors


def file_errors(directory: Path, files: Mapping[str, Any], names: Iterable[str], check_digest: bool) -> list[str]:
    """Sizes (and checksums if ``check_digest``) of ``names`` against the manifest's ``files``."""
    errors = []
    for name in names:
        path = directory / name
        want = files[name]
        try:
            size = path.stat().st_size
        except OSError:
            errors.append(f"{path}: missing (a rank's shard was not written or was removed)")
            continue
        if size != want["size"]:
            errors.append(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or replaced)")
        elif check_digest and (problem := digest.mismatch(path, want)):
            errors.append(problem)
    return errors


# -- thin I/O ---------------------------------------------------------------------------------------------------------
def list_dir(root: Path) -> Listing:
    if not root.is_dir():
        return Listing({}, [])
    entries = [(p.name, (p / MANIFEST).is_file()) for p in root.iterdir() if p.is_dir()]
    return classify(entries)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: unreadable manifest ({exc})") from exc
    errors = manifest_errors(manifest, str(path))
    if errors:
        raise UsageError(errors[0])
    return manifest


def commit(root: Path, tmp_name: str, step: int, manifest: dict[str, Any]) -> Path:
    """Write the manifest into the written-aside directory, fsync, rename it to ``step-N`` (replacing an older
    ``step-N`` by renaming that away first), fsync the root. Returns the committed path."""
    tmp = root / tmp_name
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = root / step_dir(step)
    if final.exists():
        os.replace(final, root / f"{step_dir(step)}.del-{new_token()}")
    os.replace(tmp, final)
    fsync_dir(root)
    return final


def publish(root: Path, step: int) -> None:
    """Point ``latest`` at ``step-N`` (atomically; informational, :func:`latest_step` does not need it)."""
    write_atomic(root / LATEST, f"{step_dir(step)}\n".encode())


def delete(root: Path, names: Iterable[str]) -> None:
    """Remove directories: committed ones are renamed aside first, so a crash mid-way leaves nothing that looks
    committed."""
    for name in names:
        path = root / name
        if _COMMITTED.match(name):
            aside = root / f"{name}.del-{new_token()}"
            os.replace(path, aside)
            fsync_dir(root)
            path = aside
        shutil.rmtree(path, ignore_errors=True)
