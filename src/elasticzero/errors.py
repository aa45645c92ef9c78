"""Error types shared by every elasticzero piece.

Bad user input (a malformed hostfile, contradictory flags, an unknown config key, a corrupt checkpoint) raises
:class:`UsageError` with a message that fits on one line and names the file, the line and the fix. Command-line
entry points turn it into ``<prog>: error: <message>`` on stderr and exit code 2 (see :func:`cli_main`), before
anything has been launched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

EXIT_USAGE = 2


class ElasticZeroError(Exception):
    """Base class of the errors elasticzero raises on purpose."""


class UsageError(ElasticZeroError, ValueError):
    """Bad input from the user: reported as one clear line and exit code 2; nothing is started."""


def cli_main(prog: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` and turn a :class:`UsageError` into one line on stderr and exit code 2."""
    try:
        return main(argv)
    except UsageError as exc:
        msg = " ".join(str(exc).split("\n"))
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
