"""Shared helpers for elasticzero's tests (importable as ``ez_testing``; ``tests/`` is on pytest's pythonpath).

Real parts, not mocks: a test that needs etcd, the sshd hosts, pdsh, mpirun or Slurm calls :func:`require`. Outside
CI a missing part skips with the reason; under ``CI=true`` it fails, because CI provisions every part
(``tests/cluster/up.sh``) and a skip there would hide a broken test bed.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
REPO = Path(__file__).resolve().parent.parent
TESTBED_FILE = Path(os.environ.get("EZ_TESTBED_FILE", "/run/elasticzero-testbed/testbed.json"))
PYTHON = sys.executable


def require(ok: bool, reason: str) -> None:
    """Skip (outside CI) or fail (under ``CI=true``) the calling test unless ``ok``."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"required part missing under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def require_program(*names: str) -> None:
    """Require every named program on PATH."""
    for name in names:
        require(shutil.which(name) is not None, f"{name!r} not on PATH (run: bash tests/cluster/up.sh)")


@dataclass(frozen=True)
class Testbed:
    """The cluster that ``tests/cluster/up.sh`` brought up (network-namespace hosts with sshd, Slurm)."""

    hosts: tuple[str, ...]  # node names, each its own netns + UTS ns + sshd
    addrs: tuple[str, ...]  # their addresses on the bridge
    head: str  # name of the root namespace on the bridge
    head_addr: str
    slurm_nodes: tuple[str, ...]
    netns: tuple[str, ...]  # namespace names, same order as hosts


def testbed() -> Testbed:
    """The running test bed, or skip/fail (per :func:`require`) when it is not up."""
    require(TESTBED_FILE.exists(), f"cluster test bed not up ({TESTBED_FILE} missing; run: bash tests/cluster/up.sh)")
    d = json.loads(TESTBED_FILE.read_text())
    return Testbed(
        hosts=tuple(d["hosts"]),
        addrs=tuple(d["addrs"]),
        head=d["head"],
        head_addr=d["head_addr"],
        slurm_nodes=tuple(d.get("slurm_nodes", ())),
        netns=tuple(d["netns"]),
    )


_PORTS_HANDED_OUT = itertools.count()
_PORT_WINDOW = 12000  # ports just below the kernel's ephemeral range that free_port hands out


def _bindable(host: str, port: int) -> int:
    with socket.socket() as s:
        s.bind((host, port))
        return int(s.getsockname()[1])


def _below_ephemeral() -> tuple[int, int] | None:
    """``[lo, hi)``: the ports just below ``ip_local_port_range``, or None if that leaves too few."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (first - _PORT_WINDOW, first) if first - _PORT_WINDOW >= 10000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` that nothing else takes before the caller's server binds it.

    A port found free by ``bind(0)`` is in the kernel's ephemeral range, which the kernel also hands to every
    outgoing connection (gRPC, TCPStore and gloo clients of earlier tests) and every other ``bind(0)``: one of those
    can take it before etcd or a TCPStore binds it ("bind: address already in use", seen under load). So ports come
    from just below that range, never the same one twice in a process (a restarted server reuses its own on
    purpose), starting at a pid-dependent offset for other processes doing the same, each checked bindable.
    """
    window = _below_ephemeral()
    if window is None:
        return _bindable(host, 0)
    lo, hi = window
    for _ in range(hi - lo):
        port = lo + (os.getpid() * 7919 + next(_PORTS_HANDED_OUT)) % (hi - lo)
        try:
            return _bindable(host, port)
        except OSError:
            continue
    raise RuntimeError(f"no free port in {lo}-{hi - 1} on {host}")


def run(argv: Sequence[str], timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a list, never a shell string) with a hard timeout, capturing text output."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
