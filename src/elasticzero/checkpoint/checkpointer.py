"""``Checkpointer``: save and resume every stateful piece of a training job through torch DCP.

::

    ckpt = Checkpointer("ckpt/", keep_last=2, async_save=True)
    state = {"model": ZeroCheckpointState(opt), "scaler": scaler, "sched": sched, "sampler": sampler}
    start = ckpt.load_latest(state) or 0           # None: nothing committed yet
    for step in range(start + 1, steps + 1):
        ...
        if step % save_every == 0:
            ckpt.save(step, state)                 # blocks only to snapshot (async_save) or until committed
    ckpt.close()

``state`` maps names to ``Stateful`` objects (anything with ``state_dict()`` / ``load_state_dict()``) or to plain
dicts (updated in place on load). A save is a snapshot (:mod:`~elasticzero.checkpoint.snapshot`) handed to a storage
tier (:class:`~elasticzero.checkpoint.disk.DiskTier`); a load reads into fresh buffers, checks everything, and only
then calls ``load_state_dict`` — a bad checkpoint raises one ``UsageError`` and leaves the job's state untouched.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elasticzero.checkpoint import fence
from elasticzero.checkpoint.disk import DiskTier, PhaseHook
from elasticzero.checkpoint.gcpause import PAUSE, gc_paused
from elasticzero.checkpoint.snapshot import Snapshot, Stager, fresh_like
from elasticzero.errors import UsageError

_INFO_DEPTH = 2


class Checkpointer:
    """Checkpoints of a training job in ``directory`` (see the module docstring and ``docs/checkpointing.md``).

    Args:
        directory: where ``step-N`` directories are committed (shared by all ranks: one file system).
        keep_last: committed checkpoints to keep (>= 1; older ones are deleted after a new one is committed).
        async_save: ``save`` returns once the state is snapshotted (copied to CPU staging buffers); the write and
            commit run in a background thread over ``process_group``.
        process_group: group for the checkpoint's own collectives. Default: a new gloo group over the default world,
            created here (collective) — with ``async_save`` it must be a group training does not use.
        verify_on_load: check every file's checksum against the manifest before loading (ranks split the files).
        writer_priority: with ``async_save``, the background writer thread's priority (Linux sets it per thread,
            elsewhere it is ignored). ``"idle"`` (default): ``SCHED_IDLE``, below any niceness — the write uses only
            the time the cores would otherwise idle, and a training thread that wakes takes the core from it at once.
            An int 0 … 19: that much nicer than the training loop (capped at 19); 0 writes at the training loop's
            priority (a save commits sooner on a busy machine, steps are slower meanwhile). The snapshot always runs
            in the caller.
        phase_hook: ``f(phase, step)`` called at the commit protocol's phases (``"snapshot"`` and those of
            :data:`~elasticzero.checkpoint.disk.PhaseHook`).
        read_only: only load: the directory is not claimed (see below; a job writing there is not disturbed) and
            :meth:`save` raises a :class:`UsageError`. For tools and loaders beside a job; not with ``async_save``.

    Building one is collective and, unless ``read_only``, makes its world the directory's writer
    (:mod:`~elasticzero.checkpoint.fence`): a Checkpointer built earlier on the same directory — a stale world whose
    node was declared gone and resumed — raises :class:`~elasticzero.checkpoint.fence.FencedError` at its next write,
    commit or deletion there.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 2,
        async_save: bool = False,
        process_group: Any = None,
        verify_on_load: bool = True,
        writer_priority: int | str = "idle",
        phase_hook: PhaseHook | None = None,
        read_only: bool = False,
    ) -> None:
        _check_priority(writer_priority)
        if read_only and async_save:
            raise UsageError(f"Checkpointer({directory}): read_only=True saves nothing; drop async_save=True")
        if not dist.is_initialized():
            raise UsageError("Checkpointer needs torch.distributed initialised (init_process_group)")
        group = process_group if process_group is not None else dist.new_group(backend="gloo")
        self.tier = DiskTier(directory, keep_last=keep_last, process_group=group, phase_hook=phase_hook)
        if not read_only:
            self.tier.claim()  # this world writes here from now on; an older one still running is fenced off
        self.read_only = read_only
        self.async_save = async_save
        self.verify_on_load = verify_on_load
        self._hook = phase_hook or (lambda phase, step: None)
        self._stager = Stager()
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, "elasticzero-ckpt", lower_priority, (writer_priority,))
            if async_save
            else None
        )
        self._pending: concurrent.futures.Future[Path] | None = None

    @property
    def directory(self) -> Path:
        return self.tier.root

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective). With ``async_save`` it returns after the snapshot;
        call :meth:`wait` (or the next save/load/close does) to learn that it committed. A read-only Checkpointer
        raises a :class:`UsageError` (nothing is written)."""
        if self.read_only:
            raise UsageError(fence.read_only_message(self.directory, step))
        self.wait()
        PAUSE.enter()  # automatic GC off until this save committed (see gcpause): it stalls the training thread
        try:
            snap = self.snapshot(step, state)
            self._hook("snapshot", step)
            if self._executor is not None:
                self._pending = self._executor.submit(self._write_and_resume, snap)
                return
        except BaseException:
            PAUSE.leave()
            raise
        self._write_and_resume(snap)

    def _write_and_resume(self, snap: Snapshot) -> Path:
        try:
            return self.tier.write(snap)
        finally:
            PAUSE.leave()

    def snapshot(self, step: int, state: Mapping[str, Any]) -> Snapshot:
        """Copy ``state`` into staging buffers (not collective); tensors may change as soon as it returns."""
        sds = {k: _state_dict_of(k, v) for k, v in state.items()}
        info = {k: _scalars(v, _INFO_DEPTH) for k, v in sds.items()}
        return self._stager.stage(step, sds, info)

    @property
    def saving(self) -> bool:
        """Whether a background save is still being written (not collective)."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the background save (if any) committed; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def latest_step(self) -> int | None:
        """The newest committed step (collective: rank 0 decides)."""
        self.wait()
        return self.tier.latest()

    def load_latest(self, state: Mapping[str, Any]) -> int | None:
        """Load the newest committed checkpoint into ``state``; returns its step, or ``None`` (state untouched) if
        there is none. Collective."""
        step = self.latest_step()
        if step is None:
            return None
        self.load(step, state)
        return step

    def load(self, step: int, state: Mapping[str, Any]) -> None:
        """Load step ``step`` into ``state`` (collective): read into fresh buffers, check, then ``load_state_dict``."""
        self.wait()
        with gc_paused():
            template = {k: _template_of(k, v) for k, v in state.items()}
            self.tier.read(step, template, verify=self.verify_on_load)
            for k, v in state.items():
                if hasattr(v, "load_state_dict"):
                    v.load_state_dict(template[k])
                else:
                    v.clear()
                    v.update(template[k])

    def close(self) -> None:
        """Finish the background save (re-raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_priority(priority: object) -> None:
    ok = priority == "idle" or (isinstance(priority, int) and not isinstance(priority, bool) and 0 <= priority <= 19)
    if not ok:
        raise UsageError(f"Checkpointer: writer_priority must be 'idle' or a niceness 0..19, got {priority!r}")


def lower_priority(priority: int | str) -> None:
    """Runs in the writer thread: lower its priority (only its own: Linux takes a thread id here). ``"idle"``:
    ``SCHED_IDLE`` (niceness 19 where that policy is refused); an int: that much nicer."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    if priority == "idle":
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):  # not Linux, or a sandbox that refuses it: the nicest niceness instead
            priority = 19
    if priority:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + int(priority)))


def _state_dict_of(key: str, value: Any) -> dict[str, Any]:
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return value.state_dict()
    if isinstance(value, dict):
        return value
    raise UsageError(
        f"checkpoint state {key!r} is a {type(value).__name__}: pass an object with state_dict()/load_state_dict() "
        "or a dict (updated in place on load); the step is the Checkpointer's own"
    )


def _template_of(key: str, value: Any) -> Any:
    """Fresh buffers to read ``value``'s checkpointed state into: its ``load_template()`` when it has one (a
    ``Stateful`` that can adopt the buffers it made instead of copying them, e.g.
    :class:`~elasticzero.engine.zero.dcp_state.ZeroCheckpointState`), else ``state_dict()`` with every tensor
    replaced by an uninitialised one."""
    if hasattr(value, "load_template") and hasattr(value, "load_state_dict"):
        return value.load_template()
    return fresh_like(_state_dict_of(key, value))


def _scalars(tree: Any, depth: int) -> dict[str, Any]:
    """JSON-able scalars of a state dict down to ``depth`` levels (for the manifest and ``inspect``)."""
    out: dict[str, Any] = {}
    if not isinstance(tree, Mapping) or depth == 0:
        return out
    for k, v in tree.items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[str(k)] = v
        elif isinstance(v, Mapping):
            out.update({f"{k}.{kk}": vv for kk, vv in _scalars(v, depth - 1).items()})
    return out
