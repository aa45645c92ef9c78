"""The agent plan: a pure function of (args, environment, facts); identity, rendezvous config, workers (nothing run)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest
import torch

from elasticzero import torchcompat
from elasticzero.agent.agentdirs import agent_dir
from elasticzero.agent.binding import AGENT_PID_ENV, CPUS_ENV, JOB_ID_ENV, SHIM_STUB
from elasticzero.agent.cli import build_parser, main
from elasticzero.agent.nodetable import HostFacts
from elasticzero.agent.options import RDZV_DEFAULTS, TORCHRUN_RDZV_TIMEOUT, rdzv_config
from elasticzero.agent.plan import SHARE_STORE_KNOB, AgentFacts, AgentPlan, plan_agent
from elasticzero.errors import UsageError
from elasticzero.progress import PROGRESS_FILE_ENV
from elasticzero.torchcompat import DEFAULT_SHUTDOWN_TIMEOUT

TABLE = '[["hostA",[0,1]],["hostB",[2,3,5]]]'


def parse(*argv: str, script: tuple[str, ...] = ("train.py",)) -> argparse.Namespace:
    return build_parser().parse_args([*argv, *script])


def facts(
    name: str = "elsewhere", cores: tuple[int, ...] = (0, 1, 2, 3, 4, 5), devices: int | None = None
) -> AgentFacts:
    return AgentFacts(
        pid=4242,
        python="/py",
        package_root="/site",
        run_id="fresh-id",
        host=HostFacts(frozenset({name}), frozenset({"192.0.2.1"})),
        table_addresses={"hostB": frozenset({"192.0.2.1"})} if name == "by-addr" else {},
        cores=cores,
        device_count=devices,
        shutdown_timeout_settable=torchcompat.shutdown_timeout_settable(),
    )


def plan(ns: argparse.Namespace, env: Mapping[str, str] | None = None, name: str = "elsewhere") -> AgentPlan:
    return plan_agent(ns, env or {}, facts(name))


# -- purity ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--node-table", TABLE, "--bind-cores-to-rank", "--rdzv-backend", "c10d", "--rdzv-endpoint", "hostA:29400"],
        ["--standalone", "--nproc-per-node", "2"],
        [],  # torchrun's static single-node shortcut
        ["--node-table", TABLE, "--node-rank-env", "PMI_RANK", "--rdzv-backend", "elasticzero", "--rdzv-id", "j1"],
    ],
)
def test_inputs_untouched_and_the_same_inputs_give_an_equal_plan(argv: list[str]) -> None:
    ns = parse(*argv)
    before = copy.deepcopy(vars(ns))
    environ = {"PMI_RANK": "1", "PET_NNODES": "2", "SLURMD_NODENAME": "hostB"}
    frozen_env = MappingProxyType(dict(environ))  # a write would raise
    first = plan_agent(ns, frozen_env, facts("hostA"))
    assert vars(ns) == before
    assert dict(frozen_env) == environ
    again = plan_agent(parse(*argv), dict(environ), facts("hostA"))
    assert first == again
    assert json.loads(first.to_text()) == first.to_json()  # the dry-run text is the plan, JSON-safe
    with pytest.raises(TypeError):
        first.rdzv.config["node_rank_hint"] = 7  # type: ignore[index]  # frozen all the way down
    with pytest.raises(TypeError):
        first.workers.env["X"] = "1"  # type: ignore[index]


def test_planning_does_not_touch_the_process_environment() -> None:
    before = dict(os.environ)
    plan(parse("--nproc-per-node", "4", "--standalone"))
    assert dict(os.environ) == before  # torchrun's config_from_args would have set OMP_NUM_THREADS here


# -- identity --------------------------------------------------------------------------------------------------------


def test_node_rank_with_table_gives_nproc_nnodes_and_devices() -> None:
    p = plan(parse("--node-table", TABLE, "--node-rank", "1"))
    assert (p.node_rank, p.node and p.node.slots) == (1, (2, 3, 5))
    assert (p.workers.nproc_per_node, p.rdzv.min_nodes, p.rdzv.max_nodes) == (3, 2, 2)
    assert p.workers.devices == (2, 3, 5)


def test_identity_from_env_and_host() -> None:
    assert plan(parse("--node-table", TABLE, "--node-rank-env", "PMI_RANK"), {"PMI_RANK": "0"}).node_rank == 0
    assert plan(parse("--node-table", TABLE, "--node-host", "hostB")).node_rank == 1
    env = {"SLURMD_NODENAME": "hostA"}
    assert plan(parse("--node-table", TABLE, "--node-host-env", "SLURMD_NODENAME"), env).node_rank == 0


def test_identity_by_hostname_then_address() -> None:
    assert plan(parse("--node-table", TABLE), name="hostA").node_rank == 0
    assert plan(parse("--node-table", TABLE), name="by-addr").node_rank == 1
    with pytest.raises(UsageError, match="not in the node table"):
        plan(parse("--node-table", TABLE), name="nowhere")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--node-table", TABLE, "--node-rank", "0", "--node-host", "hostA"], "contradict"),
        (["--node-rank-env", "X", "--node-host-env", "Y"], "contradict"),
        (["--node-host", "hostA"], "needs --node-table"),
        (["--node-table", TABLE, "--node-rank", "2"], "outside the node table"),
        (["--node-table", TABLE, "--node-rank", "0", "--nproc-per-node", "4"], "contradicts the node table"),
        (["--node-table", "[[1]]", "--node-rank", "0"], "entry 0"),
        (["--node-table", TABLE, "--node-host-env", "UNSET_VAR_X"], "not set"),
        (["--run-path", "--bind-cores-to-rank"], "--run-path"),
        (["--nnodes", "2:1"], "0 < MIN <= MAX"),
        (["--nnodes", "x"], "give N or MIN:MAX"),
        (["--max-restarts", "-1"], "must be >= 0"),
        (["--rdzv-backend", "c10d", "--rdzv-id", "a b"], "--rdzv-id"),
        (["--local-ranks-filter", "0,x"], "--local-ranks-filter"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--no-python", "-m"], "--no-python and --module"),
        (["--nproc-per-node", "gpu"], "no device count"),
    ],
)
def test_bad_input_is_usage_error(argv: list[str], fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        plan(parse(*argv))


def test_argparse_errors_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        build_parser().parse_args(["--node-rank", "x", "train.py"])


def test_bind_cores_split_among_local_ranks() -> None:
    p = plan(parse("--node-table", TABLE, "--node-rank", "0", "--bind-cores-to-rank"))
    assert p.workers.cpus == ((0, 1, 2), (3, 4, 5))
    assert [p.workers.worker_env(r)[CPUS_ENV] for r in (0, 1)] == ["0,1,2", "3,4,5"]


def test_without_table_defaults_like_torchrun() -> None:
    p = plan(parse())
    assert (p.node_rank, p.node, p.workers.nproc_per_node, p.workers.devices) == (None, None, 1, None)
    assert (p.rdzv.min_nodes, p.rdzv.max_nodes) == (1, 1)


def test_logs_go_to_the_agents_own_folder_unless_log_dir_names_one() -> None:
    """Without ``--log-dir``: ``$TMPDIR/elasticzero-logs-<job>-<agent pid>``, removed when the agent ends where it
    holds no file (torch's default, a ``torchelastic_*`` folder, is left behind by every agent start)."""
    p = plan(parse("--rdzv-id", "j1"), {"TMPDIR": "/scratch"})
    own = p.workers.logs
    assert (own.log_dir, own.owned) == (agent_dir({"TMPDIR": "/scratch"}, "logs", p.job_id, facts().pid), True)
    given = plan(parse("--rdzv-id", "j1", "--log-dir", "/var/log/job")).workers.logs
    assert (given.log_dir, given.owned) == ("/var/log/job", False)


def test_pet_env_fallback() -> None:
    p = plan(parse(), {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1:3", "PET_NODE_RANK": "0"})
    assert (p.workers.nproc_per_node, p.rdzv.min_nodes, p.rdzv.max_nodes) == (2, 1, 3)


def test_device_word_uses_the_probed_count() -> None:
    assert plan_agent(parse("--nproc-per-node", "gpu"), {}, facts(devices=3)).workers.nproc_per_node == 3


def test_deepspeed_underscore_spellings() -> None:
    p = plan(parse("--node_table", TABLE, "--node_host", "hostB", "--bind_cores_to_rank"))
    assert (p.node_rank, p.workers.cpus) == (1, ((0, 1), (2, 3), (4, 5)))


# -- the workers -----------------------------------------------------------------------------------------------------


def test_workers_run_through_the_shim_with_the_plans_env() -> None:
    p = plan(parse("--node-table", TABLE, "--node-rank", "1", "--rdzv-id", "job9", script=("-m", "pkg.train", "--x")))
    w = p.workers
    assert w.entrypoint == "/py"
    assert w.args == ("-S", "-c", SHIM_STUB, "/site", "--", "/py", "-u", "-m", "pkg.train", "--x")
    env = w.worker_env(2)
    assert env == {
        JOB_ID_ENV: "job9",
        AGENT_PID_ENV: "4242",
        "OMP_NUM_THREADS": "1",  # torchrun's default with several local ranks, for the workers only
        "CUDA_VISIBLE_DEVICES": "2,3,5",
        **p.collective.env,  # the collective timeout and NCCL knobs (tests/unit/agent/test_collective.py)
        PROGRESS_FILE_ENV: "/tmp/elasticzero-progress-job9-4242/rank2",  # its progress record (hang watch)
    }
    assert "OMP_NUM_THREADS" not in plan(parse("--nproc-per-node", "2"), {"OMP_NUM_THREADS": "3"}).workers.env
    virtual = plan(parse("--node-table", TABLE, "--node-rank", "1", "--virtual-local-rank")).workers
    assert [virtual.worker_env(r)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == ["2", "3", "5"]


def test_python_exec_no_python_and_run_path() -> None:
    assert plan(parse(), {"PYTHON_EXEC": "/other/py"}).workers.args[5:7] == ("/other/py", "-u")
    assert plan(parse("--no-python", script=("prog", "a"))).workers.args[5:] == ("prog", "a")
    run_path = plan(parse("--run-path", script=("train.py", "a"))).workers
    assert (run_path.entrypoint, run_path.args) == (None, ("train.py", "a"))


def test_knobs_for_the_agent_process() -> None:
    p = plan(parse("--signals-to-handle", "SIGTERM"))
    assert dict(p.torch_knobs) == {SHARE_STORE_KNOB: "1", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}
    assert plan(parse(), {SHARE_STORE_KNOB: "0"}).torch_knobs[SHARE_STORE_KNOB] == "0"  # the user's choice stays


# -- the rendezvous --------------------------------------------------------------------------------------------------


def test_standalone_and_single_node_static_get_a_fresh_c10d_rendezvous() -> None:
    for argv in (["--standalone"], [], ["--nnodes", "1"]):
        r = plan(parse(*argv)).rdzv
        assert (r.backend, r.endpoint, r.run_id) == ("c10d", "localhost:0", "fresh-id"), argv
    static = plan(parse("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5")).rdzv
    assert (static.backend, static.endpoint, static.run_id) == ("static", "10.0.0.5:29500", "none")
    assert dict(static.config) == {"rank": 1, "timeout": TORCHRUN_RDZV_TIMEOUT}
    # torchrun's PET_MASTER_PORT (read by the plan: elasticzero-run unsets the flag's default, 29500 before torch 2.12)
    pet = plan(parse("--nnodes", "1", "--master-addr", "10.0.0.5"), {"PET_MASTER_PORT": "1234"}).rdzv
    assert (pet.backend, pet.endpoint) == ("static", "10.0.0.5:1234")


def test_shutdown_timeout_is_torchs_fixed_grace_where_torch_takes_none() -> None:
    """torch 2.11 neither takes a stop grace nor reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT: the plan says what happens."""
    ns, environ = parse(), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    assert plan_agent(ns, environ, dataclasses.replace(facts(), shutdown_timeout_settable=True)).shutdown_timeout == 5
    fixed = plan_agent(ns, environ, dataclasses.replace(facts(), shutdown_timeout_settable=False))
    assert fixed.shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT


def _config(user: Mapping[str, str], backend: str, endpoint: str = "", **kw: Any) -> dict[str, object]:
    kw.setdefault("first_host", None)
    kw.setdefault("torch_defaults", False)
    return rdzv_config(user, backend, endpoint, **kw)


def test_rdzv_config_hint_defaults_and_no_phantom_timeout() -> None:
    user = {"join_timeout": "5"}
    assert _config(user, "c10d", node_rank=1) == {"join_timeout": "5", "node_rank_hint": 1, **RDZV_DEFAULTS}
    assert user == {"join_timeout": "5"}  # a new dict
    conf = {"timeout": "900", "last_call_timeout": "7"}
    assert _config(conf, "elasticzero", node_rank=None, torch_defaults=True) == conf
    assert _config({}, "static", node_rank=0) == {"timeout": TORCHRUN_RDZV_TIMEOUT, "rank": 0}


def test_live_recovery_closes_rounds_after_a_1s_last_call_unless_the_user_set_one() -> None:
    live = _config({}, "c10d", node_rank=None, live=True)
    assert live["last_call_timeout"] == "1" and RDZV_DEFAULTS["last_call_timeout"] == "2"
    assert {k: v for k, v in live.items() if k != "last_call_timeout"} == {
        k: v for k, v in RDZV_DEFAULTS.items() if k != "last_call_timeout"
    }  # the keep-alive pair (the peer timeout) is the same with or without live recovery
    assert _config({"last_call_timeout": "3"}, "etcd-v2", node_rank=None, live=True)["last_call_timeout"] == "3"
    assert "last_call_timeout" not in _config({}, "c10d", node_rank=None, live=True, torch_defaults=True)


@pytest.mark.parametrize("backend", ["c10d", "elasticzero"])
def test_is_host_from_node_table_when_endpoint_is_first_host(backend: str) -> None:
    for node_rank, expected in ((0, True), (1, False), (2, False)):
        assert _config({}, backend, "10.0.0.1:29400", node_rank=node_rank, first_host="10.0.0.1")["is_host"] is expected
    assert _config({}, backend, "10.0.0.1", node_rank=0, first_host="me@10.0.0.1")["is_host"] is True  # no port, user@
    assert _config({}, backend, "[fe80::1]:29400", node_rank=1, first_host="fe80::1")["is_host"] is False
    assert _config({}, backend, "tcp://10.0.0.1:29400", node_rank=0, first_host="10.0.0.1")["is_host"] is True


def test_is_host_left_alone() -> None:
    cases: list[tuple[dict[str, str], str, str, int | None, str | None]] = [
        ({"is_host": "true"}, "c10d", "10.0.0.1:29400", 1, "10.0.0.1"),  # the user's value wins
        ({}, "c10d", "10.0.0.9:29400", 0, "10.0.0.1"),  # endpoint elsewhere: torch's heuristic
        ({}, "elasticzero", "etcd://10.0.0.1:2379", 0, "10.0.0.1"),  # etcd: no embedded store
        ({}, "etcd-v2", "10.0.0.1:2379", 0, "10.0.0.1"),
        ({}, "c10d", "10.0.0.1:29400", 0, None),  # no node table
        ({}, "c10d", "10.0.0.1:29400", None, "10.0.0.1"),  # rank not known before the rendezvous
    ]
    for user, backend, endpoint, node_rank, first_host in cases:
        config = _config(user, backend, endpoint, node_rank=node_rank, first_host=first_host)
        assert config.get("is_host") == user.get("is_host"), (backend, endpoint, node_rank, first_host)


def test_is_host_through_the_plan() -> None:
    table = '[["10.0.0.1",[0]],["10.0.0.2",[0]]]'
    for node_rank, user_conf, expected in ((0, "", True), (1, "", False), (1, "is_host=1", "1")):
        argv = ["--node-table", table, "--node-rank", str(node_rank), "--rdzv-backend", "c10d"]
        argv += ["--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-conf", user_conf]
        assert plan(parse(*argv)).rdzv.config["is_host"] == expected


# -- torchrun's config_from_args, as data ------------------------------------------------------------------------------

TORCHRUN_CASES = [
    ["--nnodes", "1:3", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "r"],
    ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5", "--master-port", "1234", "--max-restarts", "3"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout=60,read_timeout=9"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--log-dir", "/tmp/x", "--redirects", "3"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--tee", "1", "--local-ranks-filter", "0,1"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--no-python", "--role", "trainer"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--run-path", "--monitor-interval", "0.5"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--start-method", "fork", "-m"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--local-addr", "10.1.1.1"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--duplicate-stdout-filters", "a,b"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--shutdown-timeout", "7"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--numa-binding", "node"],
    ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", "--virtual-local-rank"],
]


@pytest.mark.parametrize("argv", TORCHRUN_CASES, ids=lambda a: " ".join(a[4:]) or "static")
def test_plan_agrees_with_torchruns_config_from_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torchrun field of the plan is what torchrun's own ``config_from_args`` derives from the same flags."""
    from torch.distributed.run import config_from_args

    settable = torchcompat.shutdown_timeout_settable()
    if "--shutdown-timeout" in argv and not settable:
        pytest.skip(f"torch {torch.__version__} has no --shutdown-timeout (torch >= 2.12)")

    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    monkeypatch.setattr(os, "environ", dict(environ))  # config_from_args writes OMP_NUM_THREADS into it
    ns = parse(*argv, script=("train.py", "--lr", "1"))
    p = plan_agent(ns, environ, dataclasses.replace(facts(), python=sys.executable))  # torchrun's interpreter
    torch_ns = argparse.Namespace(**vars(ns))
    torch_ns.nproc_per_node = ns.nproc_per_node or "1"
    torch_ns.node_rank = ns.node_rank or 0
    torch_ns.logs_specs = None  # torch's DefaultLogsSpecs: compared by its settings below
    torch_ns.log_dir = ns.log_dir or os.devnull  # (no temporary directory is created for the comparison)
    config, cmd, cmd_args = config_from_args(torch_ns)
    r, w = p.rdzv, p.workers
    assert (r.min_nodes, r.max_nodes, w.nproc_per_node) == (config.min_nodes, config.max_nodes, config.nproc_per_node)
    assert (r.backend, r.endpoint, r.run_id, r.local_addr) == (
        config.rdzv_backend,
        config.rdzv_endpoint,
        config.run_id,
        config.local_addr,
    )
    ours = {k: v for k, v in r.config.items() if k not in {*RDZV_DEFAULTS, "node_rank_hint"}}
    assert ours == {k: v for k, v in config.rdzv_configs.items() if k != "timeout" or "timeout" in ours}
    assert (p.max_restarts, p.monitor_interval, p.shutdown_timeout) == (
        config.max_restarts,
        config.monitor_interval,
        config.shutdown_timeout if settable else DEFAULT_SHUTDOWN_TIMEOUT,  # torch 2.11: its fixed grace
    )
    assert (w.role, w.start_method, w.virtual_local_rank, p.event_log_handler) == (
        config.role,
        config.start_method,
        config.virtual_local_rank,
        config.event_log_handler,
    )
    assert p.torch_knobs["TORCHELASTIC_SIGNALS_TO_HANDLE"] == config.signals_to_handle
    assert list(w.duplicate_stdout_filters) == config.duplicate_stdout_filters
    numa = config.numa_options.affinity_mode.value if config.numa_options is not None else None
    assert w.numa_binding == numa
    logs = config.logs_specs
    assert (w.logs.redirects, w.logs.tee) == (ns.redirects, ns.tee)
    assert w.logs.local_ranks_filter == (frozenset(logs._local_ranks_filter) if logs._local_ranks_filter else None)
    assert ("OMP_NUM_THREADS" in w.env) == ("OMP_NUM_THREADS" in os.environ)  # torchrun set it process-wide
    if w.entrypoint is None:
        assert cmd.__name__ == "run_script_path" and tuple(cmd_args) == w.args
    else:
        assert (cmd, *cmd_args) == w.args[5:] and w.args[:5] == ("-S", "-c", SHIM_STUB, "/site", "--")


# -- --dry-run -------------------------------------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_starts_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import elasticzero.agent.launch

    def no_launch(*_: object) -> None:
        raise AssertionError("--dry-run launched")

    monkeypatch.setattr(elasticzero.agent.launch, "launch", no_launch)
    before = dict(os.environ)
    argv = ["--dry-run", "--node-table", TABLE, "--node-rank", "1", "--rdzv-backend", "elasticzero"]
    argv += ["--rdzv-endpoint", "hostA:29400", "--rdzv-id", "dry", "--hang-timeout", "45", "train.py", "--lr", "1"]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert dict(os.environ) == before  # not even the torch knobs
    assert shown["node_rank"] == 1 and shown["rendezvous"]["config"]["node_rank_hint"] == 1
    assert shown["rendezvous"]["config"]["is_host"] is False
    assert shown["workers"]["command"][-3:] == ["train.py", "--lr", "1"]
    assert shown["workers"]["command"][0] == sys.executable
    assert shown["workers"]["env"]["2"]["CUDA_VISIBLE_DEVICES"] == "2,3,5"
    assert shown["workers"]["env"]["0"][AGENT_PID_ENV] == str(os.getpid())
    assert shown["hang"]["timeout_s"] == 45 and shown["hang"]["enabled"] is True  # the hang watch, and each record:
    assert shown["workers"]["env"]["1"][PROGRESS_FILE_ENV] == os.path.join(shown["hang"]["progress_dir"], "rank1")
