"""Experiments: one configuration (a search-space point and a measuring budget) as the tuner will run it.

An experiment is plain data: its name, the trial config (the user's config with the point written in and the
tuning block removed), the script's argv with ``arg_mappings`` applied, the reservation size and the measuring
window. Its :attr:`Experiment.key` is a hash of all of that in canonical form (sorted-key JSON): the journal is keyed
by it, so an experiment that already finished is recognised after a restart and never run twice.

On disk (``exp.hjson`` in the experiment's directory) it has DeepSpeed's shape: ``name``, ``config``,
``arg_mappings``, ``num_nodes``, ``num_gpus`` (slots per node), plus ``point`` and ``steps``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticzero.autotune.dialect import get_path
from elasticzero.autotune.space import Point
from elasticzero.errors import UsageError

__all__ = ["Experiment", "find_flag", "with_flag"]


@dataclass(frozen=True)
class Experiment:
    """One run of the user's script on one reservation (see the module docstring)."""

    point: Point
    config: dict[str, Any]
    entry: tuple[str, ...]  # script and arguments, arg_mappings applied, config flag not yet pointed at a file
    nodes: int
    slots_per_node: int
    warmup_steps: int
    steps: int
    arg_mappings: dict[str, str] = field(default_factory=dict)
    rung: int = 0  # successive-halving round (0 for grid/random)

    @property
    def name(self) -> str:
        return f"{self.point.name}_s{self.steps}" if self.rung else self.point.name

    @property
    def key(self) -> str:
        """Hash of the canonical experiment: same config, argv, size and window ⇒ same key."""
        canon = json.dumps(
            {
                "config": self.config,
                "entry": list(self.entry),
                "nodes": self.nodes,
                "slots": self.slots_per_node,
                "warmup": self.warmup_steps,
                "steps": self.steps,
            },
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.key[:8]}"

    def to_record(self) -> dict[str, Any]:
        """The experiment in DeepSpeed's shape (written as ``exp.hjson``)."""
        return {
            "name": self.name,
            "key": self.key,
            "config": self.config,
            "arg_mappings": self.arg_mappings,
            "num_nodes": self.nodes,
            "num_gpus": self.slots_per_node,
            "point": self.point.values(),
            "steps": self.steps,
            "rung": self.rung,
        }


def find_flag(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), or ``None``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def with_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    """``args`` with every ``flag`` set to ``value`` (the form kept), or ``flag value`` appended."""
    out = list(args)
    found = False
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
            found = True
        elif arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            found = True
    return out if found else [*out, flag, value]


def mapped_entry(entry: Sequence[str], config: Mapping[str, Any], arg_mappings: Mapping[str, str]) -> tuple[str, ...]:
    """The script argv with each ``arg_mappings`` flag set to its config key's value in ``config``."""
    script, args = entry[0], list(entry[1:])
    for key, flag in arg_mappings.items():
        value = get_path(config, key)
        if value is None:
            raise UsageError(f"arg_mappings: config key {key!r} is not set in the trial config; fix the key")
        text = json.dumps(value) if isinstance(value, bool | dict | list) else str(value)
        args = with_flag(args, flag, text)
    return (script, *args)
