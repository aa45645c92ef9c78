"""Live recovery end to end: the example job (``examples/train_gpt.py`` through its test driver, on gloo) under real
``elasticzero-run --live-recovery`` agents, each a "node" with one worker, through the membership changes of issue 21:

1. two nodes, then one SIGKILLed (agent and worker), a node joining, a node SIGSTOPped (agent and worker: a hung
   machine) which later resumes and rejoins — in one run per :data:`CASES` entry;
2. three nodes, two SIGKILLed at once, so that some shard has no copy left: the survivor's worker leaves with
   ``ReshardFallback`` and its agent's restart path resumes the job from the newest disk checkpoint.

After the changes of 1:

- the survivor's worker is the process it started as (its pid in every record), never restarted;
- no committed step is redone: the record (one line per rank per *committed* step) has every step once, each step's
  global batch exactly once over its ranks — the in-flight step at an event is redone in the new round, but it was
  never recorded before;
- after a loss the survivor trains again within the agents' part of the change plus a few steps' time: no worker
  start, no disk (the figure is printed);
- the joiner's fresh worker and the resumed node's new worker train from their peers' state (they start past the
  newest checkpoint); every agent exits 0 at the end, nothing is left behind.

After 2: the steps since the checkpoint are redone at world 1 by the restarted worker, every step's global batch
exactly once in its last attempt. In both, the job's final parameters equal those of an uninterrupted run on the same
global batches within the ``ez_numerics`` rule (:func:`check_final_parameters`).

Why this subset covers the matrix (rendezvous x ZeRO stage x precision x 2/3 agents): the live loop's own test
(``tests/integration/live/test_live_loop.py``, forked ranks, no agents) runs every stage with fp32 and a bf16 case
through a kill, a freeze, a join and two buddies lost. What only agents add is the rendezvous backend (the round's
store and the hand-off differ between c10d and etcd; the stage and precision do not reach the agent) and the restart
path. So each backend runs the full kill/join/freeze scenario once, with a different stage and precision each
(c10d ZeRO-2 fp32, etcd ZeRO-3 bf16), and the two-buddies case (three agents, c10d) takes the remaining stage, ZeRO-1,
fp32: every stage, both precisions, both backends, 2 and 3 agents, each for its own seconds of CI time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ez_agentkit import ELASTICZERO_RUN, FAST_RDZV, Agent, Cluster, wait_for

from cluster.etcd_server import EtcdCluster, require_etcd
from elasticzero.agent.proctree import descendants
from elasticzero.data import ByteCorpus, epoch_order, stdlib_corpus
from elasticzero.proc import JOB_ID_ENV
from ez_numerics import error_ratio
from ez_testing import REPO, driver_rounds, entered, free_port, in_world

sys.path.insert(0, str(REPO / "examples"))
from gpt import GPT, config_for, lm_loss

pytestmark = [pytest.mark.multiproc, pytest.mark.clock, pytest.mark.timeout(180)]

DRIVER = Path(__file__).with_name("train_driver.py")
STEPS, GLOBAL, SEQ, CORPUS, SEED, SAVE, LR = 16, 8, 32, 4_700, 3, 4, 2.0e-3
CONFIG = f"optimizer: {{type: AdamW, params: {{lr: {LR}}}}}\ntrain_batch_size: {GLOBAL}\nmicro_batch_size: 2\n"
#: FAST_RDZV with a 6 s peer timeout (1 s x 6) and its 1 s last call: a kill must be found by its symptom (the failed
#: collective's ask, ~1.5-2.5 s here) well before the dead node's heartbeat could age out, even on a loaded machine
RDZV = FAST_RDZV.replace("keep_alive_max_attempt=4", "keep_alive_max_attempt=6")
PEER_TIMEOUT_S, LAST_CALL_S = 6.0, 1.0
assert RDZV != FAST_RDZV
#: survivor trains again after a loss within: the agents' part (timeout + last call + ~1 s of ticks, store round trips
#: and the round-number agreement, as test_live_handoff.py measures it) plus the in-memory reshard and one step of
#: this tiny job (well under 1 s each here); 3 s of slack for a loaded 2-core machine. A restart would add the worker
#: start (3.5-4 s quiet) and the checkpoint load on top.
RETRAIN_S = PEER_TIMEOUT_S + LAST_CALL_S + 1.0 + 3.0
#: seconds for any one phase (a broken run, not a measurement): a phase takes a few seconds, a worker start at most
#: ~15 s on a loaded machine; several phases failing late still end well inside the test's timeout, with the logs
WAIT = 45.0


@dataclass(frozen=True)
class Case:
    rdzv: str  # "c10d" (agent 0 hosts the TCPStore: it is never the one killed or frozen) or "etcd" (a real server)
    zero: int
    precision: str
    batch: int = GLOBAL  # sequences per step (a multiple of micro batch 2 x every world size the job passes through)

    @property
    def backend(self) -> str:
        return "c10d" if self.rdzv == "c10d" else "elasticzero"  # the elasticzero handler speaks etcd:// endpoints


CASES = [
    pytest.param(Case("c10d", 2, "fp32"), id="c10d-zero2-fp32"),
    pytest.param(Case("etcd", 3, "bf16"), id="etcd-zero3-bf16", marks=pytest.mark.etcd),
]
TWO_LOST = Case("c10d", 1, "fp32", batch=12)  # worlds 3 and 1


@pytest.fixture
def endpoint(case: Case, tmp_path: Path) -> Iterator[str]:
    """The case's rendezvous endpoint: a c10d port agent 0 will host, or a fresh etcd server's URL."""
    if case.rdzv == "c10d":
        yield f"127.0.0.1:{free_port()}"
        return
    etcd = EtcdCluster.start(tmp_path / "etcd", 1, require_etcd("3.4"))
    try:
        yield etcd.endpoint()
    finally:
        etcd.stop()


def job(tmp: Path, case: Case, name: str, steps: int) -> list[str]:
    """The example's flags (its corpus cached in ``tmp``), checkpointing into ``tmp/<name>-ckpt``."""
    (tmp / "job.yaml").write_text(CONFIG)
    args = ["--config", str(tmp / "job.yaml"), "--zero", str(case.zero), "--precision", case.precision]
    args += ["--global-batch-size", str(case.batch)]
    args += ["--size", "tiny", "--seq-len", str(SEQ), "--steps", str(steps), "--seed", str(SEED)]
    args += ["--corpus-bytes", str(CORPUS), "--cache-dir", str(tmp / "corpus")]
    return [*args, "--save-every", str(SAVE), "--checkpoint-dir", str(tmp / f"{name}-ckpt")]


def start_node(
    cluster: Cluster, case: Case, endpoint: str, steps: int = STEPS, max_restarts: int = 0, extra: tuple[str, ...] = ()
) -> Agent:
    tmp, i = cluster.tmp, len(cluster.agents)
    agent = [str(ELASTICZERO_RUN), "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", case.backend]
    agent += ["--rdzv-endpoint", endpoint, "--rdzv-id", cluster.job_id, "--rdzv-conf", RDZV]
    agent += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.2", "--live-recovery"]
    agent += ["--health-file", str(tmp / f"health{i}.json")]
    hooks = ["--record-samples", str(tmp / "record.jsonl"), "--hold-file", str(tmp / "hold"), *extra]
    return cluster.start([*agent, str(DRIVER), *job(tmp, case, "live", steps), *hooks])


def start_reference(cluster: Cluster, case: Case, steps: int) -> subprocess.Popen[bytes]:
    """The uninterrupted run: the driver run directly (one process, a world of one, no agent), on the same global
    batches, seed and steps; its final checkpoint is the run-precision reference of :func:`check_final_parameters`.
    It carries the job's id, so the cluster's cleanup reaps it too."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", JOB_ID_ENV: cluster.job_id}
    with (cluster.tmp / "ref.log").open("wb") as log:
        argv = [sys.executable, str(DRIVER), *job(cluster.tmp, case, "ref", steps)]
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finished(proc: subprocess.Popen[bytes], what: str, cluster: Cluster) -> int:
    """``proc``'s exit code once it ended (within :data:`WAIT`; else fail with the agents' logs)."""
    wait_for(lambda: proc.poll() is not None, WAIT, what, cluster.agents)
    return int(proc.returncode)


def records(cluster: Cluster) -> list[dict]:
    path = cluster.tmp / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def at(cluster: Cluster, step: int, world: int) -> list[dict]:
    """The records of ``step`` when all ``world`` ranks committed it at that world, else []."""
    found = [r for r in records(cluster) if r["step"] == step and r["world"] == world]
    return found if len(found) == world else []


def hold_at(cluster: Cluster, step: int) -> None:
    """The job holds before step ``step + 1`` (after committing ``step``)."""
    (cluster.tmp / "hold").write_text(str(step))


def handed(agent: Agent, world: int) -> int:
    """How many rounds at ``world`` the agent has handed its running workers."""
    return len(re.findall(rf"handing the workers round \d+ at world {world}, no restart", agent.output()))


def node_tree(agent: Agent) -> list:
    import psutil

    return [psutil.Process(agent.proc.pid), *descendants([agent.proc.pid])]


def worker_of(cluster: Cluster, agent: Agent, step: int, world: int) -> int:
    """The pid of ``agent``'s worker, from its record of ``step`` at ``world``."""
    pids = {p.pid for p in node_tree(agent)}
    return next(r["pid"] for r in at(cluster, step, world) if r["pid"] in pids)


def signal_node(*agents: Agent, sig: signal.Signals) -> float:
    procs = [p for agent in agents for p in node_tree(agent)]
    t = time.time()
    for p in procs:
        p.send_signal(sig)
    return t


def retrained_after(cluster: Cluster, t: float, world: int) -> dict | None:
    """The first step committed by every rank at ``world`` after wall-clock ``t``."""
    later = sorted({r["step"] for r in records(cluster) if r["world"] == world and r["time"] > t})
    return next((rs[0] for s in later if (rs := at(cluster, s, world))), None)


def global_batches(tmp: Path) -> tuple[ByteCorpus, list[int]]:
    """The corpus and the epoch's sample order (a global batch of B: B consecutive entries)."""
    data = ByteCorpus(stdlib_corpus(tmp / "corpus", "train", max_bytes=CORPUS), SEQ)
    return data, epoch_order(len(data), SEED, 0).tolist()


def check_exactly_once(recs: list[dict], steps: range, tmp: Path, batch: int = GLOBAL) -> None:
    """``recs`` (one attempt per step) hold each of ``steps`` once per rank, its global batch exactly once."""
    order = global_batches(tmp)[1]
    assert sorted({r["step"] for r in recs}) == list(steps)
    for step in steps:
        mine = [r for r in recs if r["step"] == step]
        assert sorted(r["rank"] for r in mine) == list(range(mine[0]["world"])), (step, mine)  # once per rank
        got = Counter(i for r in mine for _, i in r["samples"])
        assert got == Counter(order[(step - 1) * batch : step * batch]), step


def consolidated(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """The full fp32 model of the checkpoint of ``step`` (what ``elasticzero-checkpoint consolidate`` writes)."""
    from elasticzero.checkpoint.cli import consolidated_state_dict

    assert (ckpt / "latest").read_text().strip() == f"step-{step:08d}"
    return consolidated_state_dict(ckpt / f"step-{step:08d}")


def uninterrupted_in_float64(tmp: Path, steps: int, batch: int) -> dict[str, torch.Tensor]:
    """The job's math with neither ZeRO, processes nor rounding: the example's model from the seed, torch's AdamW with
    the config's settings, each step the mean loss over its whole global batch — in float64 (``ez_numerics``' truth).
    Every world size computes this gradient (each rank's micro-batch means, averaged over the equal-sized ones)."""
    data, order = global_batches(tmp)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)  # the example's initial weights (built in fp32), then widened
        model = GPT(config_for("tiny", vocab_size=256, block_size=SEQ)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        samples = (data[i] for i in order[step * batch : (step + 1) * batch])
        x, y = (torch.stack(t) for t in zip(*samples, strict=True))
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def check_final_parameters(cluster: Cluster, case: Case, reference: subprocess.Popen[bytes], steps: int) -> None:
    """The job's final checkpoint against the uninterrupted run, by the ``ez_numerics`` rule:

        rmse(job, truth) <= 3 * rmse(reference, truth) + U32 * rms(truth)

    ``truth``: :func:`uninterrupted_in_float64`. ``reference``: the driver run directly (world 1, same engine, stage
    and precision), so ``rmse(reference, truth)`` is what rounding in the run's precision moved this very job on this
    CPU (its kernels, this model's sums, these steps): fp32's scale for an fp32 job; for a bf16 job bf16's (forward
    and backward on a bf16 copy of the fp32 masters, gradients reduced in fp32 — the same rounding points at any world
    size). The job under test rounds the same way but at other world sizes (other micro-batch placement, another
    reduction order, the reshards copy bits exactly), so its error is of the same size; 3x is the rule's multiplier.
    A wrong step (a batch twice or lost, a shard misplaced, a stale optimizer state) is off by lr-sized amounts,
    orders of magnitude beyond the bound."""
    assert finished(reference, "the uninterrupted reference run", cluster) == 0, (cluster.tmp / "ref.log").read_text()
    got, ref = consolidated(cluster.tmp / "live-ckpt", steps), consolidated(cluster.tmp / "ref-ckpt", steps)
    ratio = error_ratio(got, ref, uninterrupted_in_float64(cluster.tmp, steps, case.batch))
    print(f"final parameters: error {ratio:.3g}x the allowed ({case.precision} rounding scale, ez_numerics rule)")
    assert ratio <= 1, f"final parameters off by {ratio:.3g}x the {case.precision} rounding scale"


@pytest.mark.parametrize("case", CASES)
def test_live_recovery_keeps_the_survivor_through_kill_join_and_freeze(
    case: Case, endpoint: str, cluster: Cluster
) -> None:  # case and endpoint first: an etcd server outlives the agents
    t0 = time.monotonic()
    hold_at(cluster, 0)  # nobody steps before both nodes are in one round (node 0 may start alone, at world 1)
    reference = start_reference(cluster, case, STEPS)
    n0 = start_node(cluster, case, endpoint)
    if case.rdzv == "c10d":
        cluster.wait_store(endpoint)  # node 0 hosts the store: it is never the one killed or frozen
    n1 = start_node(cluster, case, endpoint)
    wait_for(lambda: in_world(cluster.tmp, 2), WAIT, "both workers in one round of the two nodes", cluster.agents)
    hold_at(cluster, 3)
    wait_for(lambda: at(cluster, 3, 2), WAIT, "step 3 at world 2", cluster.agents)
    survivor = worker_of(cluster, n0, 3, 2)
    finished(reference, "the uninterrupted reference run", cluster)  # done before any timing is measured

    # 1. node 1 dies (agent and worker) while the job holds before step 4
    t_kill = signal_node(n1, sig=signal.SIGKILL)
    hold_at(cluster, 6)
    first = wait_for(lambda: retrained_after(cluster, t_kill, 1), WAIT, "training at world 1", cluster.agents)
    took = first["time"] - t_kill
    print(f"kill: the survivor (pid {first['pid']}) committed step {first['step']} at world 1 {took:.2f} s after it")
    assert first["pid"] == survivor and first["step"] == 4  # the same process, at the next step
    assert took < RETRAIN_S, took
    # found by its symptom (the step's collective failed on the closed connection), not by the heartbeat's timeout
    assert "did not answer within" in n0.output() and "silent for more than the peer timeout" not in n0.output()

    # 2. a node joins at step 6: the job grows back to world 2 in the same survivor process, which trains on at world 1
    #    (here: holds before step 7) until the joiner's worker is ready, then enters the round at world 2
    wait_for(lambda: at(cluster, 6, 1), WAIT, "step 6 at world 1", cluster.agents)
    grown = entered(cluster.tmp, survivor, 2)
    n2 = start_node(cluster, case, endpoint)
    grew = lambda: entered(cluster.tmp, survivor, 2) > grown  # noqa: E731
    wait_for(grew, WAIT, "the survivor in a round at world 2", cluster.agents)
    assert handed(n0, 2) >= 1
    hold_at(cluster, 9)
    wait_for(lambda: at(cluster, 7, 2), WAIT, "step 7 at world 2", cluster.agents)
    joiner = next(r["pid"] for r in at(cluster, 7, 2) if r["pid"] != survivor)

    # 3. the joined node freezes (agent and worker) at step 9; the survivor goes on alone, then the node resumes:
    #    its agent finds itself dropped, stops its stale worker and joins again with a fresh one
    wait_for(lambda: at(cluster, 9, 2), WAIT, "step 9 at world 2", cluster.agents)
    t_stop = signal_node(n2, sig=signal.SIGSTOP)
    hold_at(cluster, 12)
    first = wait_for(lambda: retrained_after(cluster, t_stop, 1), WAIT, "training at world 1", cluster.agents)
    took = first["time"] - t_stop
    print(f"freeze: the survivor committed step {first['step']} at world 1 {took:.2f} s after it")
    assert first["pid"] == survivor and first["step"] == 10 and took < RETRAIN_S, (first, took)
    wait_for(lambda: at(cluster, 12, 1), WAIT, "step 12 at world 1", cluster.agents)
    grown = entered(cluster.tmp, survivor, 2)
    # 12 is a save step and the job holds before its checkpoint: the node rejoins between the commit and the save,
    # which both members must take in the new round (a survivor taking it alone hung the round: the join race)
    assert 12 % SAVE == 0, "keep the rejoin at a save step"
    signal_node(n2, sig=signal.SIGCONT)
    grew = lambda: entered(cluster.tmp, survivor, 2) > grown  # noqa: E731
    wait_for(grew, WAIT, "the survivor in a round at world 2", cluster.agents)
    hold_at(cluster, STEPS)
    wait_for(lambda: at(cluster, 13, 2), WAIT, "step 13 at world 2 (the resumed node rejoined)", cluster.agents)
    rejoined = next(r["pid"] for r in at(cluster, 13, 2) if r["pid"] != survivor)
    assert rejoined != joiner  # the stale worker was stopped; a fresh one joined

    (cluster.tmp / "hold").unlink()
    assert [finished(a.proc, "the agents' exit", cluster) for a in (n0, n1, n2)] == [0, -signal.SIGKILL, 0]
    mine = sorted((r for r in records(cluster) if r["pid"] == survivor), key=lambda r: r["step"])
    assert [r["step"] for r in mine] == list(range(1, STEPS + 1))  # never restarted, every step once
    assert [r["world"] for r in mine] == [2] * 3 + [1] * 3 + [2] * 3 + [1] * 3 + [2] * 4
    models = [r["model"] for r in driver_rounds(cluster.tmp) if r["pid"] == survivor]
    assert len(models) >= 5, models  # the first round and four changes (at least)
    if case.zero in (1, 2) and case.precision == "fp32":  # ZeroOptimizer.rewrappable: the example's build keeps it
        assert len(set(models)) == 1, models  # (a fresh model per round may reuse a freed one's id: not checked)
    check_exactly_once(records(cluster), range(1, STEPS + 1), cluster.tmp)
    check_final_parameters(cluster, case, reference, STEPS)
    assert cluster.leftovers() == []
    print(f"{case}: {time.monotonic() - t0:.1f} s")


CUT_STEPS, CUT_AT = 7, 4


def test_a_dropped_connection_between_live_nodes_drops_no_node(cluster: Cluster) -> None:
    """Rank 1's worker shuts down its connections to rank 0's worker before step ``CUT_AT``: the step's collective fails
    on both nodes — a crash's symptom, with both nodes alive. The agents ask before they drop anyone
    (``agent/suspicion.py``): both answer, the round re-forms with both, and the job trains on at world 2 in the same
    two processes, every step once, the cut step redone in the new round."""
    case, endpoint = Case("c10d", 2, "fp32"), f"127.0.0.1:{free_port()}"
    cut = ("--cut-at", str(CUT_AT), "--cut-rank", "1")
    hold_at(cluster, 0)
    n0 = start_node(cluster, case, endpoint, steps=CUT_STEPS, extra=cut)
    cluster.wait_store(endpoint)
    n1 = start_node(cluster, case, endpoint, steps=CUT_STEPS, extra=cut)
    wait_for(lambda: in_world(cluster.tmp, 2), WAIT, "both workers in one round of the two nodes", cluster.agents)
    hold_at(cluster, CUT_AT - 1)
    wait_for(lambda: at(cluster, CUT_AT - 1, 2), WAIT, f"step {CUT_AT - 1} at world 2", cluster.agents)
    workers = {worker_of(cluster, n0, CUT_AT - 1, 2), worker_of(cluster, n1, CUT_AT - 1, 2)}
    (cluster.tmp / "hold").unlink()
    assert [finished(a.proc, "the agents' exit", cluster) for a in (n0, n1)] == [0, 0]
    out = n0.output() + n1.output()
    assert "train_driver: rank 1 cut" in out and "every node answered: re-forming with all of them" in out, out
    assert "asked whether this node is alive" in out, out
    assert "did not answer" not in out and "was dropped" not in out, out
    recs = records(cluster)
    assert {r["pid"] for r in recs} == workers and {r["world"] for r in recs} == {2}
    check_exactly_once(recs, range(1, CUT_STEPS + 1), cluster.tmp)
    assert cluster.leftovers() == []


def test_two_buddies_lost_at_once_fall_back_to_the_disk_checkpoint(cluster: Cluster) -> None:
    """Three nodes train; two are SIGKILLed at once after step ``kill_at`` (past the checkpoint of step ``SAVE``).
    Each rank's copy lives on another node, so with two of three gone some state has no copy left: the survivor's
    worker leaves with ``ReshardFallback`` (exit non-zero), its agent spends a restart (``--max-restarts 1``) and the
    fresh worker resumes the job from the newest disk checkpoint at world 1 — the steps since it are redone, each
    step's global batch is trained exactly once in its last attempt, and the job ends where an uninterrupted run
    ends."""
    t0, case, steps, kill_at = time.monotonic(), TWO_LOST, 10, 6
    endpoint = f"127.0.0.1:{free_port()}"
    hold_at(cluster, 0)  # nobody steps before all three are in one round
    reference = start_reference(cluster, case, steps)
    n0 = start_node(cluster, case, endpoint, steps, max_restarts=1)
    cluster.wait_store(endpoint)  # node 0 hosts the store: the survivor
    n1, n2 = start_node(cluster, case, endpoint, steps), start_node(cluster, case, endpoint, steps)
    wait_for(lambda: in_world(cluster.tmp, 3), WAIT, "the workers in one round of the three nodes", cluster.agents)
    hold_at(cluster, kill_at)
    wait_for(lambda: at(cluster, kill_at, 3), WAIT, f"step {kill_at} at world 3", cluster.agents)
    survivor = worker_of(cluster, n0, kill_at, 3)
    finished(reference, "the uninterrupted reference run", cluster)

    t_kill = signal_node(n1, n2, sig=signal.SIGKILL)  # while the job holds before step kill_at + 1
    first = wait_for(lambda: retrained_after(cluster, t_kill, 1), WAIT, "training at world 1 again", cluster.agents)
    print(f"two lost: step {first['step']} committed at world 1 {first['time'] - t_kill:.2f} s after the kill")
    wait_for(lambda: at(cluster, kill_at, 1), WAIT, f"step {kill_at} redone at world 1", cluster.agents)
    state = n0.state() or {}  # while the job holds again (the file goes when the agent ends)
    assert state.get("restart_count") == 1 and state.get("world_size") == 1, state  # one restart spent
    (cluster.tmp / "hold").unlink()
    assert [finished(a.proc, "the agents' exit", cluster) for a in (n0, n1, n2)] == [0] + [-signal.SIGKILL] * 2
    log = n0.output()
    assert "ReshardFallback: in-memory reshard impossible: both copies of the state of old rank" in log, log[-3000:]

    before = [r for r in records(cluster) if r["time"] < t_kill]
    after = [r for r in records(cluster) if r["time"] > t_kill]
    check_exactly_once(before, range(1, kill_at + 1), cluster.tmp, case.batch)
    check_exactly_once(after, range(SAVE + 1, steps + 1), cluster.tmp, case.batch)  # steps 5, 6 redone
    assert {r["world"] for r in before} == {3} and {r["world"] for r in after} == {1}
    restarted = {r["pid"] for r in after}
    assert len(restarted) == 1 and survivor not in restarted
    check_final_parameters(cluster, case, reference, steps)
    assert cluster.leftovers() == []
    print(f"{case} two lost: {time.monotonic() - t0:.1f} s")
