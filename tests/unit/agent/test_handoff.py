"""Live recovery, the agent's side (``--live-recovery``): the flag's checks (what a membership change does with the
running workers: tests/unit/agent/test_tick.py), the round number the agents agree on, and the round file each
node's workers get.

The agreement runs over a real c10d ``TCPStore`` with one thread per agent (the agents of one rendezvous round)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticzero.agent.cli import build_parser
from elasticzero.agent.handoff import (
    AGREE_TIMEOUTS,
    AGREE_TRIES,
    LivePlan,
    RoundAgreementError,
    RoundFacts,
    RoundKeeper,
    check_live_recovery,
    handoff_line,
    live_plan,
    node_round,
    retry_agreement,
)
from elasticzero.agent.liveness import peer_plan
from elasticzero.agent.plan import AgentFacts, AgentPlan, plan_agent
from elasticzero.errors import UsageError
from elasticzero.launch.args import parse_args
from elasticzero.launch.cli import build_plan
from elasticzero.rounds import ROUND_FILE_ENV, RoundFile, parse_node_round, round_prefix
from ez_testing import free_port

FACTS = AgentFacts(pid=4242, python="/py", package_root="/site", run_id="fresh-id")


def agent_plan(*argv: str) -> AgentPlan:
    return plan_agent(build_parser().parse_args([*argv, "train.py"]), {"TMPDIR": "/scratch"}, FACTS)


# -- the flag -------------------------------------------------------------------------------------------------------
def test_off_by_default_and_on_shows_the_round_file_in_the_dry_run_and_every_workers_env() -> None:
    dyn = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j1", "--nnodes", "1:2")
    off = agent_plan(*dyn, "--nproc-per-node", "2")
    assert off.to_json()["live_recovery"] is None
    assert all(ROUND_FILE_ENV not in env for env in off.to_json()["workers"]["env"].values())
    on = agent_plan(*dyn, "--nproc-per-node", "2", "--live-recovery").to_json()
    path = "/scratch/elasticzero-round-j1-4242/round.json"  # per agent and job, beside the progress records
    assert on["live_recovery"]["round_file"] == path
    assert {env[ROUND_FILE_ENV] for env in on["workers"]["env"].values()} == {path}  # one file per node
    assert json.loads(json.dumps(on)) == on


@pytest.mark.parametrize(
    "argv",
    [
        ("--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "h", "--master-port", "29500"),
        ("--nnodes", "1"),  # torchrun's single-node static shortcut is c10d: allowed, see below
    ],
)
def test_a_static_rendezvous_is_refused_in_one_line(argv: tuple[str, ...]) -> None:
    if "static" not in argv:
        assert agent_plan(*argv, "--live-recovery").workers.live is not None
        return
    with pytest.raises(UsageError, match=r"^--live-recovery needs a dynamic rendezvous .*not static\)") as err:
        agent_plan(*argv, "--node-rank", "0", "--live-recovery")
    assert "\n" not in str(err.value)


def test_no_peer_liveness_is_refused() -> None:
    with pytest.raises(UsageError, match="--live-recovery needs peer liveness"):
        live_plan(True, "c10d", None, {}, "j1", 1)
    plan = peer_plan("6", {}, torch_defaults=False)
    live = live_plan(True, "elasticzero", plan, {}, "j1", 1)
    assert live is not None and live.agree_timeout_s == AGREE_TIMEOUTS * plan.timeout_s
    assert live.round_dir.startswith("/tmp/")  # no TMPDIR
    assert live_plan(False, "static", None, {}, "j1", 1) is None  # off: nothing checked


def test_the_launcher_passes_the_flag_to_every_agent_and_refuses_static(tmp_path: Path) -> None:
    plan = build_plan(*parse_args(["--nnodes", "1:2", "--live-recovery", "t.py"]), {}, str(tmp_path))
    assert "--live-recovery" in plan.agent_argv(["--node-rank", "0"])
    plan = build_plan(*parse_args(["--nnodes", "1:2", "t.py"]), {}, str(tmp_path))
    assert "--live-recovery" not in plan.agent_argv(["--node-rank", "0"])
    with pytest.raises(UsageError, match="--live-recovery needs a dynamic rendezvous"):
        build_plan(*parse_args(["--rdzv-backend", "static", "--live-recovery", "t.py"]), {}, str(tmp_path))
    check_live_recovery("etcd-v2")  # every dynamic backend is fine


# -- a failed agreement --------------------------------------------------------------------------------------------
def test_a_failed_agreement_rendezvouses_again_a_bounded_number_of_times() -> None:
    assert AGREE_TIMEOUTS >= 2  # a node missing after 2 peer timeouts is stale: the next rendezvous drops it
    tries = [t for t in range(1, 10) if retry_agreement(t)]
    assert tries == list(range(1, AGREE_TRIES))


# -- the round file --------------------------------------------------------------------------------------------------
FACTS2 = RoundFacts(ranks=((1, 3), (0, 2)), world_size=4, master_addr="10.0.0.1", master_port=29611, agent_store=False)


def test_node_round_is_what_the_workers_parse() -> None:
    r = node_round(7, FACTS2)
    assert (r.number, r.world_size, r.rank_of(0), r.rank_of(1), r.prefix) == (7, 4, 2, 3, round_prefix(7))
    assert (r.store.host, r.store.port, r.store.rank0_hosts) == ("10.0.0.1", 29611, True)  # fresh store per round
    assert parse_node_round(r.to_json().encode()) == r
    assert round_prefix(7) != round_prefix(8)
    shared = node_round(7, RoundFacts(((0, 0),), 1, "h", 1, agent_store=True))
    assert not shared.store.rank0_hosts  # torch's use_agent_store: the agents' store serves the round
    assert handoff_line(7, 4, "x") == "elasticzero-run: x; handing the workers round 7 at world 4, no restart"


def _keepers(tmp_path: Path, n: int, timeout_s: float = 10.0) -> list[RoundKeeper]:
    return [RoundKeeper(LivePlan(str(tmp_path / f"node{i}"), timeout_s)) for i in range(n)]


def _publish_all(store: dist.TCPStore, keepers: list[RoundKeeper], prefix: str) -> list[int]:
    """One rendezvous round: every agent (a thread each, its own client) publishes over the round's prefix."""
    out: list[int] = [-1] * len(keepers)

    def one(i: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
        facts = RoundFacts(((0, i),), len(keepers), "127.0.0.1", 29999, False, i, len(keepers))
        out[i] = keepers[i].publish(dist.PrefixStore(prefix, client), facts).number

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(keepers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_agents_agree_on_the_round_over_the_store_and_write_their_files(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30))
    a, b, c = _keepers(tmp_path, 3)
    assert _publish_all(store, [a, b], "rdzv.0/") == [0, 0]  # the first round
    assert _publish_all(store, [a, b], "rdzv.1/") == [1, 1]  # a hand-off
    assert _publish_all(store, [b, c, a], "rdzv.2/") == [2, 2, 2]  # c joins with none
    seen = RoundFile(c.plan.round_file).poll(-1)
    assert seen is not None and not isinstance(seen, Exception) and seen.number == 2
    assert Path(c.plan.round_file).parent.stat().st_mode & 0o777 == 0o700
    c.remove()
    assert not Path(c.plan.round_dir).exists()


def test_a_missing_agent_fails_the_agreement_in_bounded_time(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30))
    (a,) = _keepers(tmp_path, 1, timeout_s=0.5)
    with pytest.raises(RoundAgreementError, match="did not all publish their last round number within"):
        a.publish(dist.PrefixStore("r/", store), RoundFacts(((0, 0),), 2, "h", 1, False, 0, 2))  # 2 agents, 1 here
    assert a.last is None and not Path(a.plan.round_file).exists()
