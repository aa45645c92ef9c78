"""The disk tier: writes a :class:`~elasticzero.checkpoint.snapshot.Snapshot` as a DCP checkpoint and commits it
(:mod:`~elasticzero.checkpoint.commit`), reads the newest committed one back into a template.

Every method here is collective over ``process_group`` (all its ranks call it, in the same order); nothing else may
use that group concurrently when saves run in the background.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elasticzero.checkpoint import commit, fence
from elasticzero.checkpoint.planner import ZeroLoadPlanner, ZeroSavePlanner, read_metadata_file
from elasticzero.checkpoint.reader import FastFileSystemReader
from elasticzero.checkpoint.snapshot import Snapshot
from elasticzero.checkpoint.writer import ChecksummingFileSystemWriter
from elasticzero.errors import UsageError

PhaseHook = Callable[[str, int], None]
"""Called with ``(phase, step)`` at ``"written"`` (every rank's DCP files are on disk), ``"manifest"`` (before the
commit rename), ``"committed"``, ``"published"`` and ``"retained"`` (old checkpoints deleted): failure-injection
points for tests (SIGKILL a rank there) and progress reporting."""


class DiskTier:
    """Checkpoints under ``directory``: ``step-N`` directories committed atomically, the newest ``keep_last`` kept."""

    def __init__(
        self, directory: str | Path, *, keep_last: int, process_group: Any = None, phase_hook: PhaseHook | None = None
    ) -> None:
        if keep_last < 1:
            raise UsageError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(directory)
        self.keep_last = keep_last
        self.process_group = process_group
        self._hook = phase_hook or (lambda phase, step: None)
        self._token: str | None = None  #: this world's writer token (:meth:`claim`); None: not fenced

    def claim(self) -> None:
        """Make this world the directory's writer (collective; :mod:`~elasticzero.checkpoint.fence`): a world that
        claimed it before — a node declared gone that resumes later — can no longer write or commit here."""
        self._token = self._agree(fence.claim(self.root) if self.rank == 0 else None)

    def _check_fence(self, what: str, step: int) -> None:
        if self._token is not None:
            fence.check(self.root, what, step, self._token)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    # -- save ---------------------------------------------------------------------------------------------------------
    def write(self, snap: Snapshot) -> Path:
        """Write and commit ``snap`` (collective). Returns the committed directory."""
        snap.wait_ready()  # its staging copies from CUDA are asynchronous
        self._check_fence("this rank's write", snap.step)
        token = self._agree(commit.new_token() if self.rank == 0 else None)
        tmp_name = commit.tmp_dir(snap.step, token)
        if self.rank == 0:
            (self.root / tmp_name).mkdir(parents=True)
        dist.barrier(group=self.process_group)
        writer = ChecksummingFileSystemWriter(self.root / tmp_name, sync_files=True)
        dcp.save(snap.state, storage_writer=writer, planner=ZeroSavePlanner(), process_group=self.process_group)
        self._hook("written", snap.step)
        files = self._gather_files(self.root / tmp_name, writer.files)
        final = self.root / commit.step_dir(snap.step)
        if self.rank == 0:
            self._commit(tmp_name, snap, files)
        dist.barrier(group=self.process_group)
        return final

    def _commit(self, tmp_name: str, snap: Snapshot, files: dict[str, Any]) -> None:
        manifest = {
            "format": commit.FORMAT_VERSION,
            "step": snap.step,
            "world_size": self.world_size,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "nbytes": snap.nbytes,
            "files": files,
            "info": snap.info,
        }
        self._hook("manifest", snap.step)
        self._check_fence("the commit", snap.step)
        commit.commit(self.root, tmp_name, snap.step, manifest)
        self._hook("committed", snap.step)
        commit.publish(self.root, snap.step)
        self._hook("published", snap.step)
        self._check_fence("deleting old checkpoints", snap.step)
        commit.delete(self.root, commit.to_delete(commit.list_dir(self.root), self.keep_last, snap.step))
        self._hook("retained", snap.step)

    def _gather_files(self, directory: Path, written: dict[str, dict[str, int]]) -> dict[str, Any]:
        """Size and checksum of every file, each computed by the rank that wrote it while writing it, gathered on every
        rank. A file on disk whose size differs from what went through the stream raises (nothing is committed)."""
        for name, rec in written.items():
            if (directory / name).stat().st_size != rec["size"]:
                raise RuntimeError(f"{directory / name}: size on disk differs from the bytes written")
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, written, group=self.process_group)
        return {k: v for p in parts for k, v in p.items()}

    # -- load ---------------------------------------------------------------------------------------------------------
    def latest(self) -> int | None:
        """The newest committed step as rank 0 sees it (collective: every rank gets the same answer)."""
        return self._agree(commit.latest_step(commit.list_dir(self.root)) if self.rank == 0 else None)

    def read(self, step: int, template: dict[str, Any], *, verify: bool = True) -> dict[str, Any]:
        """Load step ``step`` into ``template`` (fresh buffers; filled in place) after checking the manifest, every
        file's size (and checksum if ``verify``) and that the checkpoint has every entry of the template with the
        same shape. Any problem: one ``UsageError`` on every rank, naming the file and what is wrong."""
        directory = self.root / commit.step_dir(step)
        read: dict[str, Any] = {}  # what the check read and the load reuses (.metadata)
        self._raise_any(lambda: self._check(directory, template, False, read))
        with concurrent.futures.ThreadPoolExecutor(1, "elasticzero-digest") as pool:
            # checksums while DCP reads into the fresh template (the hash and preadv release the GIL); checked before
            # anything live is touched, and a damaged file is named before what reading it did
            sums = pool.submit(self._digest_errors, directory) if verify else None
            failed = self._load_into(directory, template, read.get("metadata"))
            if sums is not None:
                self._raise_any(sums.result)
        if failed is not None:
            raise failed
        return self.read_manifest(directory)

    def _load_into(self, directory: Path, template: dict[str, Any], metadata: Any) -> UsageError | None:
        try:
            dcp.load(
                template,
                storage_reader=FastFileSystemReader(directory, metadata=metadata),
                planner=ZeroLoadPlanner(),
                process_group=self.process_group,
            )
        except CheckpointException as exc:
            err = UsageError(f"{directory}: {_first_failure(exc)}")
            err.__cause__ = exc
            return err
        return None

    def _digest_errors(self, directory: Path) -> list[str]:
        files = commit.read_manifest(directory)["files"]
        try:
            return commit.file_errors(directory, files, self._mine(files), True)
        except OSError as exc:  # an error string, so every rank still reaches the collective that reports it
            return [f"{directory}: a file could not be read for its checksum ({exc})"]

    def _mine(self, files: dict[str, Any]) -> list[str]:
        """The files this rank checks (the ranks split them round-robin)."""
        return [n for i, n in enumerate(sorted(files)) if i % self.world_size == self.rank]

    def read_manifest(self, directory: Path) -> dict[str, Any]:
        return commit.read_manifest(directory)

    def _check(self, directory: Path, template: dict[str, Any], verify: bool, read: dict[str, Any]) -> list[str]:
        try:
            manifest = commit.read_manifest(directory)
        except UsageError as exc:
            return [str(exc)]
        files = manifest["files"]
        errors = commit.file_errors(directory, files, self._mine(files), verify)
        errors += commit.file_errors(directory, files, [".metadata"], False) if ".metadata" in files else []
        if not errors:
            read["metadata"] = read_metadata_file(str(directory / ".metadata"))  # UsageError if not DCP's metadata
        return errors

    def _raise_any(self, check: Callable[[], list[str]]) -> None:
        """Run ``check`` on every rank; if any rank found a problem, raise the first one everywhere."""
        try:
            errors = check()
        except UsageError as exc:
            errors = [str(exc)]
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, errors, group=self.process_group)
        found = list(dict.fromkeys(e for p in parts for e in p))
        if found:
            more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
            raise UsageError(found[0] + more)

    def _agree(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        return box[0]


def _first_failure(exc: CheckpointException) -> str:
    failures = getattr(exc, "failures", {}) or {}
    for rank, pair in sorted(failures.items()):
        err = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(err, UsageError):
            return str(err)
        return f"could not be read (rank {rank}: {type(err).__name__}: {err})"
    return f"could not be read ({exc})"
