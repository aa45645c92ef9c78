"""elasticzero-run's flags: identity resolution, contradictions, rendezvous config (no process started)."""

from __future__ import annotations

import argparse

import pytest

from elasticzero.agent.cli import build_parser
from elasticzero.agent.nodetable import HostFacts
from elasticzero.agent.options import RDZV_DEFAULTS, AgentSettings, rdzv_configs, resolve
from elasticzero.errors import UsageError

TABLE = '[["hostA",[0,1]],["hostB",[2,3,5]]]'


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*argv, "train.py"])


def settle(ns: argparse.Namespace, env: dict[str, str] | None = None, name: str = "elsewhere") -> AgentSettings:
    return resolve(
        ns,
        env=env or {},
        host_facts=lambda: HostFacts(frozenset({name}), frozenset({"192.0.2.1"})),
        resolver=lambda table: {"hostB": {"192.0.2.1"}} if name == "by-addr" else {},
        cores=lambda: [0, 1, 2, 3, 4, 5],
    )


def test_node_rank_with_table_sets_nproc_and_nnodes() -> None:
    ns = parse("--node-table", TABLE, "--node-rank", "1")
    s = settle(ns)
    assert (s.node_rank, s.node and s.node.slots) == (1, (2, 3, 5))
    assert (ns.nproc_per_node, ns.nnodes, ns.node_rank) == ("3", "2", 1)


def test_identity_from_env_and_host() -> None:
    assert settle(parse("--node-table", TABLE, "--node-rank-env", "PMI_RANK"), {"PMI_RANK": "0"}).node_rank == 0
    assert settle(parse("--node-table", TABLE, "--node-host", "hostB")).node_rank == 1
    env = {"SLURMD_NODENAME": "hostA"}
    assert settle(parse("--node-table", TABLE, "--node-host-env", "SLURMD_NODENAME"), env).node_rank == 0


def test_identity_by_hostname_then_address() -> None:
    assert settle(parse("--node-table", TABLE), name="hostA").node_rank == 0
    assert settle(parse("--node-table", TABLE), name="by-addr").node_rank == 1
    with pytest.raises(UsageError, match="not in the node table"):
        settle(parse("--node-table", TABLE), name="nowhere")


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
    ],
)
def test_bad_input_is_usage_error(argv: list[str], fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        settle(parse(*argv))


def test_argparse_errors_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        build_parser().parse_args(["--node-rank", "x", "train.py"])


def test_bind_cores_split_among_local_ranks() -> None:
    s = settle(parse("--node-table", TABLE, "--node-rank", "0", "--bind-cores-to-rank"))
    assert s.cpus == [[0, 1, 2], [3, 4, 5]]


def test_without_table_defaults_like_torchrun() -> None:
    ns = parse()
    s = settle(ns)
    assert (s.node_rank, s.node, ns.nproc_per_node, ns.nnodes, ns.node_rank) == (None, None, "1", "1:1", 0)


def test_pet_env_fallback() -> None:
    ns = parse()
    settle(ns, {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1:3"})
    assert (ns.nproc_per_node, ns.nnodes) == ("2", "1:3")


def _settings(node_rank: int | None, defaults: bool = True) -> AgentSettings:
    return AgentSettings("j", node_rank, None, None, None, defaults)


def test_rdzv_configs_hint_defaults_and_no_phantom_timeout() -> None:
    cfg: dict[str, object] = {"timeout": 900, "join_timeout": "5"}
    rdzv_configs(cfg, {"join_timeout"}, _settings(1), "c10d")
    assert cfg == {"join_timeout": "5", "node_rank_hint": 1, **RDZV_DEFAULTS}
    cfg = {"timeout": 900, "last_call_timeout": "7"}
    rdzv_configs(cfg, {"timeout", "last_call_timeout"}, _settings(None, defaults=False), "elasticzero")
    assert cfg == {"timeout": 900, "last_call_timeout": "7"}
    cfg = {"timeout": 900, "rank": 0}
    rdzv_configs(cfg, set(), _settings(0), "static")
    assert cfg == {"timeout": 900, "rank": 0}


def test_deepspeed_underscore_spellings() -> None:
    ns = parse("--node_table", TABLE, "--node_host", "hostB", "--bind_cores_to_rank")
    s = settle(ns)
    assert (s.node_rank, s.cpus) == (1, [[0, 1], [2, 3], [4, 5]])


def _table_settings(node_rank: int, first_host: str = "10.0.0.1") -> AgentSettings:
    return AgentSettings("j", node_rank, None, None, None, True, first_host=first_host)


@pytest.mark.parametrize("backend", ["c10d", "elasticzero"])
def test_is_host_from_node_table_when_endpoint_is_first_host(backend: str) -> None:
    for node_rank, expected in ((0, True), (1, False), (2, False)):
        cfg: dict[str, object] = {}
        rdzv_configs(cfg, set(), _table_settings(node_rank), backend, "10.0.0.1:29400")
        assert cfg["is_host"] is expected
    cfg = {}
    rdzv_configs(cfg, set(), _table_settings(0, first_host="me@10.0.0.1"), backend, "10.0.0.1")  # no port, user@
    assert cfg["is_host"] is True
    cfg = {}
    rdzv_configs(cfg, set(), _table_settings(1, first_host="fe80::1"), backend, "[fe80::1]:29400")
    assert cfg["is_host"] is False
    cfg = {}
    rdzv_configs(cfg, set(), _table_settings(0), backend, "tcp://10.0.0.1:29400")
    assert cfg["is_host"] is True


def test_is_host_left_alone() -> None:
    cases = [
        ({"is_host": "true"}, {"is_host"}, _table_settings(1), "c10d", "10.0.0.1:29400"),  # the user's value wins
        ({}, set(), _table_settings(0), "c10d", "10.0.0.9:29400"),  # endpoint elsewhere: torch's heuristic
        ({}, set(), _table_settings(0), "elasticzero", "etcd://10.0.0.1:2379"),  # etcd: no embedded store
        ({}, set(), _table_settings(0), "etcd-v2", "10.0.0.1:2379"),
        ({}, set(), _settings(0), "c10d", "10.0.0.1:29400"),  # no node table
        ({}, set(), AgentSettings("j", None, None, None, None, True, "10.0.0.1"), "c10d", "10.0.0.1:29400"),
    ]
    for cfg, user_keys, settings, backend, endpoint in cases:
        before = cfg.get("is_host")
        rdzv_configs(cfg, user_keys, settings, backend, endpoint)
        assert cfg.get("is_host") == before, (settings, backend, endpoint)


def test_is_host_through_resolve_and_torch_config() -> None:
    """End to end through the parser, resolve and torch's config_from_args, as cli._launch does."""
    from torch.distributed.run import _parse_rendezvous_config, config_from_args

    table = '[["10.0.0.1",[0]],["10.0.0.2",[0]]]'
    for node_rank, user_conf, expected in ((0, "", True), (1, "", False), (1, "is_host=1", "1")):
        argv = ["--node-table", table, "--node-rank", str(node_rank), "--rdzv-backend", "c10d"]
        argv += ["--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-conf", user_conf]
        ns = parse(*argv)
        settings = settle(ns)
        config, _, _ = config_from_args(ns)
        rdzv_configs(
            config.rdzv_configs, set(_parse_rendezvous_config(user_conf)), settings, "c10d", config.rdzv_endpoint
        )
        assert config.rdzv_configs["is_host"] == expected
