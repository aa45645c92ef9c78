"""Per-rank log files named by *global* rank and restart attempt (``torchrun --logs-specs elasticzero`` too).

Layout under ``<log_dir>/<run_id>/``::

    rank<R>.attempt<A>.stdout.log    rank<R>.attempt<A>.stderr.log    rank<R>.attempt<A>.error.json
    node<G>.attempt<A>.filtered_stdout.log / .filtered_stderr.log   (only with --duplicate-*-filters)

How the global rank is known: torch calls :meth:`LogsSpecs.reify` from ``_start_workers``, i.e. *after* the
rendezvous, with each local rank's final environment, which already holds ``RANK`` (global rank),
``GROUP_RANK`` and ``TORCHELASTIC_RESTART_COUNT`` (``A``). So the names come from those variables; no agent
hook is needed and plain ``torchrun`` gets the same layout. Agents on one host share ``<log_dir>/<run_id>/``
without clobbering: global ranks are unique within a round, and if a name exists already (a membership change
restarts workers without bumping the restart count) a ``.1``, ``.2`` … suffix is added before the extension.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, Std, to_map

_CONSOLE = ""  # LogsDest's marker for "leave on the console"


class ElasticZeroLogsSpecs(DefaultLogsSpecs):
    """Logs layout by global rank and attempt; constructed as ``cls(log_dir, redirects, tee, local_ranks_filter)``."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Build each local rank's destinations from its post-rendezvous environment (see module docstring)."""
        if self._root_log_dir == os.devnull:
            return self._devnull(envs)
        first = envs.get(0, {})
        run_dir = Path(str(self._root_log_dir)) / first.get("TORCHELASTIC_RUN_ID", "run")
        run_dir.mkdir(parents=True, exist_ok=True)
        attempt = first.get("TORCHELASTIC_RESTART_COUNT", "0")
        nprocs = len(envs)
        redirs = to_map(self._redirects, nprocs)
        tees = to_map(self._tee, nprocs)
        dest = LogsDest()
        for local_rank, env in envs.items():
            stem = _unique_stem(run_dir, f"rank{env.get('RANK', local_rank)}.attempt{attempt}")
            tee = tees[local_rank]
            redirect = redirs[local_rank] | tee
            filt = self._local_ranks_filter
            hidden = bool(filt and local_rank not in filt)
            for std, name, files, tee_files in (
                (Std.OUT, "stdout", dest.stdouts, dest.tee_stdouts),
                (Std.ERR, "stderr", dest.stderrs, dest.tee_stderrs),
            ):
                path = str(run_dir / f"{stem}.{name}.log")
                files[local_rank] = path if redirect & std == std else (os.devnull if hidden else _CONSOLE)
                if tee & std == std and not hidden:
                    tee_files[local_rank] = path
            error_file = str(run_dir / f"{stem}.error.json")
            dest.error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        node = first.get("GROUP_RANK", "0")
        dest.filtered_stdout = str(run_dir / f"node{node}.attempt{attempt}.filtered_stdout.log")
        dest.filtered_stderr = str(run_dir / f"node{node}.attempt{attempt}.filtered_stderr.log")
        return dest

    @staticmethod
    def _devnull(envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            dest.tee_stdouts[local_rank] = os.devnull
            dest.tee_stderrs[local_rank] = os.devnull
            dest.error_files[local_rank] = os.devnull
            dest.stdouts[local_rank] = _CONSOLE
            dest.stderrs[local_rank] = _CONSOLE
            env["TORCHELASTIC_ERROR_FILE"] = ""
        return dest

    def __repr__(self) -> str:
        return (
            f"ElasticZeroLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
            f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})"
        )


def _unique_stem(run_dir: Path, stem: str) -> str:
    """``stem``, or ``stem.N`` with the smallest N for which none of the rank's files exist yet."""
    candidate, n = stem, 0
    while any((run_dir / f"{candidate}.{kind}").exists() for kind in ("stdout.log", "stderr.log", "error.json")):
        n += 1
        candidate = f"{stem}.{n}"
    return candidate
