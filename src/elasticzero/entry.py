"""``elasticzero-launch``, the console script: the launcher, and with ``--autotuning tune|run`` the tuner.

The tuner builds on the launcher (its flags, its pool; every trial is a ``python -m elasticzero.launch.cli``
process), so the one command that reaches both sits above both: this module parses the launcher's flags once and
hands them to :func:`elasticzero.autotune.cli.run_from_launch` (``--autotuning``; imported only then, so a plain
launch never loads the tuner) or to :func:`elasticzero.launch.cli.run`. Neither package imports the other's way up
(docs/architecture.md, the layers; ``tests/unit/test_import_graph.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from elasticzero.errors import cli_main
from elasticzero.launch import cli
from elasticzero.launch.args import PROG, parse_args


def _run(argv: Sequence[str] | None) -> int:
    try:
        args, entry = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.autotuning:  # docs/autotuning.md
        from elasticzero.autotune.cli import run_from_launch

        return run_from_launch(args, entry, args.autotuning)
    return cli.run(args, entry)


def launch(argv: Sequence[str] | None = None) -> int:
    """Console script ``elasticzero-launch``: returns the exit code (2 on bad input, nothing started)."""
    return cli_main(PROG, _run, argv)


if __name__ == "__main__":
    sys.exit(launch())
