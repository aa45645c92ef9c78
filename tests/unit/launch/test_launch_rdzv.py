"""The rendezvous in the launch plan: ``--rdzv-endpoint`` (c10d or etcd), ``--rdzv-conf`` checked once, the etcd
password passed by name only (launch/rdzv.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from elasticzero.launch.args import parse_args
from elasticzero.launch.cli import bind_plan, main

Executions = Any  # the launch_env fixture (conftest.Executions)
PASSWORD = "pw-3f9a1c-never-printed"
ETCD = "etcd://10.200.0.1:2379,etcd-b:2380"


def _hostfile(path: Path, text: str = "w0 slots=2\nw1 slots=2\n") -> str:
    path.write_text(text)
    return str(path)


def _dry(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict[str, Any], str]:
    """The JSON and the text dry run of ``argv`` (both printed in full, stderr included)."""
    assert main([*argv[:-1], "--dry-run=json", argv[-1]]) == 0
    first = capsys.readouterr()
    assert main([*argv[:-1], "--dry-run", argv[-1]]) == 0
    second = capsys.readouterr()
    return json.loads(first.out), first.err + second.out + second.err


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], launched: Executions) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert launched.calls == []
    return lines[0].removeprefix("elasticzero-launch: error: ")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_an_etcd_endpoint_reaches_every_agent(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hf = _hostfile(tmp_path / "hf")
    plan, text = _dry(capsys, ["-H", hf, "--launcher", "fake", "--nnodes", "1:2", "--rdzv-endpoint", ETCD, "t.py"])
    assert (plan["rdzv_backend"], plan["rdzv_endpoint"]) == ("elasticzero", ETCD)
    assert len(plan["commands"]) == 2
    for argv in plan["commands"]:
        assert (_flag(argv, "--rdzv-backend"), _flag(argv, "--rdzv-endpoint")) == ("elasticzero", ETCD)
        assert _flag(argv, "--rdzv-conf") is None  # nothing added: is_host is the agent's, c10d only
    assert f"endpoint:  {ETCD} (rdzv elasticzero)" in text


def test_tls_user_and_the_password_by_name_only(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The password travels as an exported variable (masked), never in an argv or the dry run; the pdsh backend
    is bound too: a value in its remote command would be refused by bind."""
    monkeypatch.setenv("ELASTICZERO_ETCD_PASSWORD", PASSWORD)
    hf = _hostfile(tmp_path / "hf")
    conf = "cacert=/etc/ez/ca.pem,cert=/etc/ez/me.pem,key=/etc/ez/me.key,user=ezjob"
    for launcher in ("fake", "pdsh"):
        argv = ["-H", hf, "--launcher", launcher, "--no-ssh-check", "--rdzv-endpoint", "etcds://e1:2379"]
        plan, text = _dry(capsys, [*argv, "--rdzv-conf", conf, "t.py"])
        assert plan["env"]["ELASTICZERO_ETCD_PASSWORD"] == "****"
        assert PASSWORD not in json.dumps(plan) and PASSWORD not in text
        bound, _ = bind_plan(*parse_args([*argv, "--rdzv-conf", conf, "t.py"]), os.environ, "/w")
        assert bound.plan.env["ELASTICZERO_ETCD_PASSWORD"] == PASSWORD
        assert all(PASSWORD not in arg for cmd in bound.commands for arg in cmd.argv)
        if launcher == "fake":
            assert all(_flag(list(c.argv), "--rdzv-conf") == conf for c in bound.commands)


def test_a_password_variable_named_by_password_env(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOB_ETCD_PASSWORD", PASSWORD)
    argv = [
        "--launcher",
        "fake",
        "--rdzv-endpoint",
        "etcd://e1",
        "--rdzv-conf",
        "user=u,password_env=JOB_ETCD_PASSWORD",
    ]
    plan, text = _dry(capsys, [*argv, "t.py"])
    assert plan["env"] == {"JOB_ETCD_PASSWORD": "****"} and PASSWORD not in text


def test_a_c10d_endpoint_is_the_master_address(launch_env: Executions, capsys, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path / "hf")
    plan, _ = _dry(capsys, ["-H", hf, "--launcher", "fake", "--rdzv-endpoint", "w1:1234", "t.py"])
    assert (plan["master_addr"], plan["master_port"], plan["rdzv_endpoint"]) == ("w1", 1234, "w1:1234")
    assert all(_flag(c, "--rdzv-endpoint") == "w1:1234" for c in plan["commands"])


BAD = [
    (
        ["--master-addr", "etcd://10.200.0.1:2379"],
        "--master-addr takes a host name or address, not the URL 'etcd://10.200.0.1:2379'; name a rendezvous "
        "endpoint with --rdzv-endpoint etcd://10.200.0.1:2379",
    ),
    (
        ["--rdzv-endpoint", ETCD, "--master-addr", "w0"],
        "--rdzv-endpoint and --master-addr both name the rendezvous; give it once (--rdzv-endpoint HOST:PORT or "
        "etcd://H:P, or --master-addr/--master-port)",
    ),
    (["--rdzv-endpoint", ETCD, "--master-port", "1"], "--rdzv-endpoint and --master-port both name the rendezvous"),
    (
        ["--rdzv-endpoint", ETCD, "--rdzv-backend", "c10d"],
        f"--rdzv-endpoint {ETCD}: only --rdzv-backend elasticzero speaks etcd v3 (got --rdzv-backend c10d)",
    ),
    (["--rdzv-endpoint", "ftp://e1"], "unknown scheme 'ftp'"),
    (["--rdzv-endpoint", "etcd://e1:99999"], "port '99999' is not a number in 1..65535"),
    (["--rdzv-endpoint", "etcd://a;b:2379"], "--rdzv-endpoint etcd://a;b:2379: invalid host name 'a;b'"),
    (
        ["--rdzv-conf", "user=u"],
        "--rdzv-conf user= applies to an etcd endpoint (--rdzv-endpoint etcd://H:P) only; drop it or change the "
        "endpoint",
    ),
    (["--rdzv-endpoint", ETCD, "--rdzv-conf", "is_host=true"], "--rdzv-conf is_host= applies to a c10d store only"),
    (["--rdzv-endpoint", ETCD, "--rdzv-conf", "password=x"], "--rdzv-conf password= is refused"),
    (["--rdzv-conf", "join_timout=60"], "unknown --rdzv-conf key(s) for the elasticzero rendezvous: join_timout"),
    (["--rdzv-endpoint", ETCD, "--rdzv-conf", "cert=/c.pem"], "cert= and key= go together"),
    (
        ["--rdzv-endpoint", ETCD, "--rdzv-conf", "user=u,password_env=ETCD_PW"],
        "--rdzv-conf password_env=ETCD_PW: the launcher hides values by their name and ETCD_PW does not look secret",
    ),
    (
        ["--rdzv-endpoint", ETCD, "--rdzv-conf", "user=u"],
        "--rdzv-conf user=: every agent reads the etcd password from $ELASTICZERO_ETCD_PASSWORD, which is not set "
        "here; export ELASTICZERO_ETCD_PASSWORD=… in this shell or an env file (never on the command line)",
    ),
    (
        ["--rdzv-endpoint", "etcd://e1,127.0.0.1:2379"],
        "rendezvous on --rdzv-endpoint 127.0.0.1 is a loopback address but the job spans 2 nodes: every node would "
        "host its own rendezvous (split brain); pass --rdzv-endpoint with names or addresses every node can reach",
    ),
    (["--rdzv-endpoint", ETCD, "--per-rank", "--launcher", "openmpi"], "per-rank mode starts every rank without"),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_rendezvous_flags_are_one_line(
    flags: list[str],
    message: str,
    launch_env: Executions,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv("ELASTICZERO_ETCD_PASSWORD", raising=False)
    hf = _hostfile(tmp_path / "hf")
    launcher = [] if "--launcher" in flags else ["--launcher", "fake"]
    for dry in (["--dry-run"], []):
        assert message in _error(capsys, ["-H", hf, *launcher, *flags, *dry, "t.py"], launch_env)


def test_one_local_node_may_use_a_loopback_etcd(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    plan, _ = _dry(capsys, ["--launcher", "local", "--rdzv-endpoint", "etcd://127.0.0.1:2379", "t.py"])
    assert plan["rdzv_endpoint"] == "etcd://127.0.0.1:2379"
