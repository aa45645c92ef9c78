"""Slurm's compact host-list and count syntaxes, expanded without calling ``scontrol``.

* :func:`expand_hostlist`: ``node[1-3,5],gpu[01-02]`` → ``node1 node2 node3 node5 gpu01 gpu02``; several bracket
  groups in one name expand as a product (``r[1-2]n[1-2]`` → ``r1n1 r1n2 r2n1 r2n2``); zero padding follows the
  width of the lower bound, as Slurm does.
* :func:`expand_counts`: ``SLURM_TASKS_PER_NODE`` style ``2(x3),1`` → ``[2, 2, 2, 1]``.

Pure functions; malformed input raises :class:`~elasticzero.errors.UsageError` naming the variable.
"""

from __future__ import annotations

import itertools
import re

from elasticzero.errors import UsageError

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _split_top(text: str, name: str) -> list[str]:
    """Split ``text`` at commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise UsageError(f"{name}={text!r}: nested '[' in host list")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"{name}={text!r}: unbalanced ']' in host list")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"{name}={text!r}: unbalanced '[' in host list")
    parts.append(text[start:])
    return parts


def _expand_group(group: str, text: str, name: str) -> list[str]:
    out: list[str] = []
    for item in group.split(","):
        m = _RANGE.fullmatch(item)
        if not m:
            raise UsageError(f"{name}={text!r}: bad range {item!r} in host list")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise UsageError(f"{name}={text!r}: range {item!r} runs backwards")
        width = len(lo_s)
        out += [str(i).zfill(width) for i in range(lo, hi + 1)]
    return out


def expand_hostlist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm host list (order preserved, duplicates kept as given)."""
    hosts: list[str] = []
    for part in _split_top(text.strip(), name):
        if not part:
            raise UsageError(f"{name}={text!r}: empty entry in host list")
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_group(piece[1:-1], text, name))
            elif piece:
                choices.append([piece])
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def expand_counts(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand a Slurm per-node count list like ``2(x3),1``."""
    counts: list[int] = []
    for item in text.strip().split(","):
        m = _COUNT.fullmatch(item)
        if not m:
            raise UsageError(f"{name}={text!r}: bad entry {item!r}; expected N or N(xR)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
