"""A node comes back under ``--live-recovery`` (issue 33): the example job (through its test driver) launched over real
pdsh on the namespace hosts 2 and 3, ``--nnodes 1:2 --live-recovery --max-node-restarts 2``, then host 3 is lost:

* ``partition``: packets between the two hosts dropped (tc, both ways) for 10 s, then healed. The survivor (host 2,
  the c10d store's) trains on at world 1 after the peer timeout; host 3's agent, cut off from the store, stops its
  worker and keeps trying; after the heal it joins as a new node and its fresh worker joins the running job live;
* ``killed``: every process of host 3 — agent, worker and its sshd — SIGKILLed; sshd back 3 s later. The launcher
  starts host 3's agent again (``--max-node-restarts``), which joins the running job live.

In both, the survivor's worker is the process it started as, never restarted, and commits every step once; each
step's global batch is consumed exactly once over its ranks; the job finishes, the launcher exits 0 and nothing of
the job is left on any host. The times printed (the survivor at world 1 after the loss, world 2 after the heal or the
kill) are the closing note's figures.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from launchkit import kill_job, leftovers, wait_for, worker_env_clean

import ez_testing
from elasticzero.agent.liveness import DEFAULT_PEER_TIMEOUT_S
from elasticzero.agent.options import RDZV_DEFAULTS
from elasticzero.data import ByteCorpus, epoch_order, stdlib_corpus
from ez_testing import REPO, agents_slack, entered, free_port, in_world, partition, require, require_program

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
DRIVER = REPO / "tests" / "integration" / "elastic" / "train_driver.py"
STEPS, GLOBAL, SEQ, CORPUS, SEED = 14, 4, 32, 4_700, 5
CONFIG = f"optimizer: {{type: AdamW, params: {{lr: 2.0e-3}}}}\ntrain_batch_size: {GLOBAL}\nmicro_batch_size: 2\n"
#: seconds for one phase of the job (a broken run, not a measurement)
WAIT = 90.0

pytestmark = [pytest.mark.multiproc, pytest.mark.pdsh, pytest.mark.sshd, pytest.mark.clock, pytest.mark.timeout(300)]


def records(tmp: Path) -> list[dict]:
    path = tmp / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def at(tmp: Path, step: int, world: int) -> list[dict]:
    """The records of ``step`` when all ``world`` ranks committed it at that world, else []."""
    found = [r for r in records(tmp) if r["step"] == step and r["world"] == world]
    return found if len(found) == world else []


def handed(log: Path, host: str, world: int) -> int:
    """How many rounds at ``world`` the agent on ``host`` has handed its running worker (pdsh prefixes its lines)."""
    line = rf"^{re.escape(host)}: .*handing the workers round \d+ at world {world}, no restart"
    return len(re.findall(line, log.read_text(), re.M))


def hold_at(tmp: Path, step: int) -> None:
    (tmp / "hold").write_text(str(step))


def first_after(tmp: Path, t: float, world: int) -> dict | None:
    """The first step committed by every rank at ``world`` after wall-clock ``t``."""
    later = sorted({r["step"] for r in records(tmp) if r["world"] == world and r["time"] > t})
    return next((rs[0] for s in later if (rs := at(tmp, s, world))), None)


def start(tmp: Path, hosts: list[str], job: str) -> tuple[subprocess.Popen[bytes], Path]:
    (tmp / "hostfile").write_text(f"{hosts[0]} slots=1\n{hosts[1]} slots=1\n")
    (tmp / "job.yaml").write_text(CONFIG)
    argv = [LAUNCH, "--hostfile", str(tmp / "hostfile"), "--launcher", "pdsh", "--nnodes", "1:2"]
    argv += ["--master-port", str(free_port()), "--rdzv-id", job, "--live-recovery", "--max-node-restarts", "2"]
    argv += [str(DRIVER), "--config", str(tmp / "job.yaml"), "--zero", "2", "--global-batch-size", str(GLOBAL)]
    argv += ["--size", "tiny", "--seq-len", str(SEQ), "--steps", str(STEPS), "--seed", str(SEED)]
    argv += ["--corpus-bytes", str(CORPUS), "--cache-dir", str(tmp / "corpus"), "--log-every", "100"]
    argv += ["--record-samples", str(tmp / "record.jsonl"), "--hold-file", str(tmp / "hold")]
    log = tmp / "launch.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(argv, env={**worker_env_clean(), "OMP_NUM_THREADS": "1"}, cwd=tmp, stdout=fh,
                                stderr=subprocess.STDOUT)  # fmt: skip
    return proc, log


def check_exactly_once(recs: list[dict], tmp: Path) -> None:
    """Every step once per rank of its world, its global batch exactly once over them."""
    data = ByteCorpus(stdlib_corpus(tmp / "corpus", "train", max_bytes=CORPUS), SEQ)
    order = epoch_order(len(data), SEED, 0).tolist()
    assert sorted({r["step"] for r in recs}) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        mine = [r for r in recs if r["step"] == step]
        assert sorted(r["rank"] for r in mine) == list(range(mine[0]["world"])), (step, mine)
        got = Counter(i for r in mine for _, i in r["samples"])
        assert got == Counter(order[(step - 1) * GLOBAL : step * GLOBAL]), step


def _restart_sshd() -> None:
    subprocess.run(["bash", str(REPO / "tests" / "cluster" / "hosts_up.sh")], check=True, timeout=120)


@pytest.mark.parametrize("lost", ["partition", "killed"])
def test_a_lost_node_comes_back_live_and_the_survivor_never_restarts(tmp_path: Path, lost: str) -> None:
    tb = ez_testing.testbed()
    require_program("pdsh", "tc")
    require(len(tb.hosts) >= 3, "the test uses hosts 2 and 3 of the test bed (1 and 2 serve other tests)")
    hosts = [tb.hosts[1], tb.hosts[2]]
    job = f"ezlive-{secrets.token_hex(4)}"
    tmp = tmp_path
    hold_at(tmp, 1)
    launcher, log = start(tmp, hosts, job)
    tail = lambda: log.read_text()[-5000:]  # noqa: E731
    try:
        k = one_round_of_two(tmp, launcher, tail)
        survivor = next(r["pid"] for r in at(tmp, k, 2) if r["rank"] == 0)
        assert survivor in leftovers(job, tb)[hosts[0]]  # rank 0 is host 2's: the store's node survives
        handed_before, entered_before = handed(log, hosts[0], 2), entered(tmp, survivor, 2)
        t_loss = time.time()
        if lost == "partition":
            with partition(tb, 1, 2):
                hold_at(tmp, k + 2)  # the survivor commits k+1 and k+2 alone, then holds for the rejoin
                first = wait_for_first(tmp, t_loss, 1, tail)
                time.sleep(max(0.0, t_loss + 10 - time.time()))  # the link down for 10 s
            t_back = time.time()
        else:
            victims = [psutil.Process(pid) for pid in leftovers(job, tb)[hosts[1]]]
            sshd = psutil.Process(int(Path(f"/run/elasticzero-testbed/sshd-{hosts[1]}.pid").read_text()))
            for proc in [sshd, *victims]:
                proc.send_signal(signal.SIGKILL)
            hold_at(tmp, k + 2)
            first = wait_for_first(tmp, t_loss, 1, tail)
            time.sleep(max(0.0, t_loss + 3 - time.time()))
            _restart_sshd()  # sshd is back: the launcher's next try reaches the host
            t_back = time.time()
        print(f"{lost}: the survivor committed step {first['step']} at world 1 {first['time'] - t_loss:.2f} s after it")
        assert first["pid"] == survivor and first["step"] == k + 1, first
        # the job holds before step k+3: the node joins during the hold (the survivor's agent hands its worker a round
        # at world 2; the worker enters it once the joiner's worker is ready), then the hold is released and step
        # k+3 is the first at world 2
        again = lambda: entered(tmp, survivor, 2) > entered_before  # noqa: E731
        wait_for(again, WAIT, "the survivor's worker in a round at world 2 again", tail)
        assert handed(log, hosts[0], 2) > handed_before, tail()
        (tmp / "hold").unlink()
        back = wait_for_first(tmp, t_back, 2, tail)
        assert back["step"] == k + 3, back
        after = "the heal" if lost == "partition" else "sshd came back"
        print(f"{lost}: world 2 again {back['time'] - t_back:.2f} s after {after}")
        if lost == "partition":
            # the cut-off node's next try (1 s apart), a rendezvous round, its fresh worker's start-up and state
            # fetch: within the peer timeout + a round + the agents' slack + 1.5 x a worker start-up measured here
            # (the survivor's: process start -> training began)
            mine = min((r for r in records(tmp) if r["pid"] == survivor), key=lambda r: r["step"])
            startup = mine["loaded"] - mine["started"]
            bound = DEFAULT_PEER_TIMEOUT_S + int(RDZV_DEFAULTS["last_call_timeout"]) + agents_slack(startup)
            bound += 1.5 * startup
            assert back["time"] - t_back < bound, (back["time"] - t_back, bound, startup)
        joined = {r["pid"] for r in at(tmp, back["step"], 2)} - {survivor}
        assert joined and joined.isdisjoint({r["pid"] for r in records(tmp) if r["time"] < t_loss}), joined
        launcher.wait(timeout=WAIT)
        assert launcher.returncode == 0, tail()
        mine = sorted((r for r in records(tmp) if r["pid"] == survivor), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == list(range(1, STEPS + 1))  # never restarted, every step once
        check_exactly_once(records(tmp), tmp)
        if lost == "killed":
            assert f"{hosts[1]}'s agent ended (" in log.read_text(), tail()
        wait_for(lambda: not leftovers(job, tb), 20, "no process of the job on any host")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_job(job)


def one_round_of_two(tmp: Path, launcher: subprocess.Popen[bytes], tail: Callable[[], str]) -> int:
    """Hold the job before step 2 until both workers are in one round at world 2 (host 3's node may join after host 2
    started alone, at world 1: it then joins live, during the hold), then let step 2 run; 2, with the job holding
    after it."""
    hold_at(tmp, 1)
    both = lambda: in_world(tmp, 2) or launcher.poll() is not None  # noqa: E731
    wait_for(both, WAIT, "both workers in a round at world 2", tail)
    assert launcher.poll() is None, tail()
    hold_at(tmp, 2)
    wait_for(lambda: at(tmp, 2, 2) or launcher.poll() is not None, WAIT, "step 2 at world 2", tail)
    assert at(tmp, 2, 2), tail()
    return 2


def wait_for_first(tmp: Path, t: float, world: int, tail: Callable[[], str]) -> dict:
    """The first step committed by every rank at ``world`` after ``t`` (waiting for it)."""
    wait_for(lambda: first_after(tmp, t, world) is not None, WAIT, f"a step at world {world}", tail)
    found = first_after(tmp, t, world)
    assert found is not None
    return found
