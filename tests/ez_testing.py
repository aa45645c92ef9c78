"""Shared helpers for elasticzero's tests (importable as ``ez_testing``; ``tests/`` is on pytest's pythonpath).

Real parts, not mocks: a test that needs etcd, the sshd hosts, pdsh, mpirun or Slurm calls :func:`require`. Outside
CI a missing part skips with the reason; under ``CI=true`` it fails, because CI provisions every part
(``tests/cluster/up.sh``) and a skip there would hide a broken test bed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ez_ports import free_port as free_port  # re-exported: tests import it from here

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
REPO = Path(__file__).resolve().parent.parent
TESTBED_FILE = Path(os.environ.get("EZ_TESTBED_FILE", "/run/elasticzero-testbed/testbed.json"))
PYTHON = sys.executable


#: the prefix that runs a command with SIGHUP, SIGINT and SIGQUIT at their defaults, as from a terminal: a test run
#: started in the background of a shell without job control, or under ``nohup``, inherits SIGINT and SIGQUIT (or
#: SIGHUP) ignored, and the agent keeps an ignored stop signal ignored as it should (agent/stopsignals.py) — a test
#: that signals an agent it started must start it so
AS_FROM_A_TERMINAL = [
    PYTHON,
    "-c",
    "import os, signal, sys\n"
    "for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT): signal.signal(s, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])",
]


def pythonpath_with_tests(*more: Path) -> str:
    """A ``PYTHONPATH`` for a worker process that imports the tests' own modules (``ez_numerics``, ``hf_worker``, …):
    ``tests/``, then ``more``, then the caller's (pytest's ``pythonpath`` setting reaches only pytest's process)."""
    paths = [str(REPO / "tests"), *map(str, more), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


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


def tc(netns: str, *args: str) -> None:
    """``tc`` inside a namespace host (an argv list; fails loudly)."""
    subprocess.run(["ip", "netns", "exec", netns, "tc", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def partition(tb: Testbed, a: int, b: int) -> Iterator[None]:
    """Drop every packet host ``a`` sends to host ``b`` and back; heal on exit (also on an exception or Ctrl-C).

    In each of the two namespaces: an htb root whose default class passes everything, and a class holding a zero-length
    FIFO (every packet it gets is dropped) that a u32 filter sends the peer's packets to — no action module needed,
    and the rest of the test bed (other hosts, the head) is not touched.
    """
    cut = [(tb.netns[a], tb.addrs[b]), (tb.netns[b], tb.addrs[a])]
    try:
        for ns, peer in cut:
            tc(ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "2")
            tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "1kbit")
            tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit")
            tc(ns, "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:", "pfifo", "limit", "0")
            tc(ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "dst", f"{peer}/32", "flowid", "1:1")  # fmt: skip
        yield
    finally:
        for ns, _ in cut:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=30, check=False)  # fmt: skip


@contextmanager
def link_down(tb: Testbed, a: int) -> Iterator[None]:
    """Take host ``a``'s only link down (its processes live on, cut off from everything); up again on exit."""
    ip = ["ip", "-n", tb.netns[a], "link", "set", "eth0"]
    try:
        subprocess.run([*ip, "down"], check=True, capture_output=True, timeout=30)
        yield
    finally:
        subprocess.run([*ip, "up"], capture_output=True, timeout=30, check=False)


def run(argv: Sequence[str], timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a list, never a shell string) with a hard timeout, capturing text output."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]


def run_driver(driver: Path, out: Path, timeout: float = 300) -> None:
    """Run ``python driver out`` — a driver that imports torch once and forks each case's ranks itself — with one
    OpenMP thread per process; it must exit 0 (its stderr's end is the failure message)."""
    done = run([PYTHON, str(driver), str(out)], timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-4000:]


def run_ranks(
    worker: Path, world: int, out: Path, timeout: float = 240, args: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Run ``python worker out *args`` as ``world`` gloo ranks on loopback (``RANK``/``WORLD_SIZE``/``MASTER_*`` set);
    every rank must exit 0 without a C++ abort, and rank r's JSON result is read from ``{out}.rank{r}``."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [PYTHON, str(worker), str(out), *args],
            env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(world)),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-3000:]}"
        assert "terminate called" not in err, err[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def agents_slack(startup: float) -> float:
    """The slack to allow an agents' part of a recovery on top of its timers (peer or hang timeout, a monitor tick, the
    rendezvous' last call): the agents' own work — stopping workers, the process exits, the round's store traffic, the
    spawn — which is CPU work like a worker's start-up and slows with the machine's load as that does. So it is taken in
    proportion to ``startup``, a worker start-up (interpreter, torch, model, process group) measured in the same run:
    on a quiet 2-core machine the agents' work came to 0.7-1.9 s past the timers beside start-ups of 7.0-8.7 s (at most
    0.27 of it), so 0.3 of it, and never under 1.5 s."""
    return max(1.5, 0.3 * startup)


# -- the test driver's round record (tests/integration/elastic/train_driver.py, ``<record>.rounds``) ------------------
def driver_rounds(tmp: Path) -> list[dict[str, Any]]:
    """The rounds the driver's workers started in and entered, in order (``tmp``: where ``record.jsonl`` is)."""
    path = tmp / "record.rounds"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def entered(tmp: Path, pid: int, world: int) -> int:
    """How many rounds at ``world`` worker ``pid`` started in or entered."""
    return sum(1 for r in driver_rounds(tmp) if r["pid"] == pid and r["world"] == world)


def in_world(tmp: Path, world: int) -> bool:
    """``world`` workers are in a round at ``world``, each by its latest round (a worker trains on in its round until
    every member of the new one is ready: the workers' view, not the agents')."""
    latest = {r["pid"]: r["world"] for r in driver_rounds(tmp)}
    return sum(1 for w in latest.values() if w == world) == world
