"""The main loop the repeat-a-case stress scripts share: ``--runs`` fresh runs of one case, each under ``--timeout``.

A script gives :func:`main` its description and ``one_run(timeout) -> Run``; one line per run (seconds, ok or FAILED,
then the run's lines indented) and a summary are printed; the exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NamedTuple


class Run(NamedTuple):
    """One run's outcome: its seconds, whether it passed, and what to print under it (timings, or the failure)."""

    seconds: float
    ok: bool
    lines: list[str]


def report(i: int, run: Run) -> str:
    """The lines printed for the ``i``-th run (from 1)."""
    head = f"run {i}: {run.seconds:.1f} s {'ok' if run.ok else 'FAILED'}"
    return "\n".join([head, *(f"  {line}" for line in run.lines)])


def main(description: str, one_run: Callable[[float], Run]) -> None:
    """Parse ``--runs``/``--timeout``, run ``one_run`` that often, print each run and the summary, exit."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600, help="seconds for one run (default 600)")
    args = p.parse_args()
    failed = 0
    for i in range(1, args.runs + 1):
        run = one_run(args.timeout)
        failed += not run.ok
        print(report(i, run), flush=True)
    print(f"{args.runs - failed}/{args.runs} runs passed")
    sys.exit(1 if failed else 0)
