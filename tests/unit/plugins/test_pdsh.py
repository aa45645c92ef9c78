"""pdsh: the one remote shell string and the env file, checked through real pdsh (``-R exec``) and sh."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from plugin_plans import HOSTILE, PY, make_plan

from elasticzero.errors import UsageError
from elasticzero.launch.backend import get_launcher
from elasticzero.launch.cli import render_plan
from elasticzero.launch.plan import LaunchPlan
from elasticzero_plugins._common import job_env
from elasticzero_plugins.pdsh import env_dir, env_payload, remote_command, ssh_base, stage_script, unstage_script
from ez_testing import require

PROG = "import json,os,sys; print(json.dumps([os.getcwd(), {k: v for k, v in os.environ.items() if k.startswith('EZT_')}, sys.argv[1:]]))"  # noqa: E501


def test_pdsh_argv_shape_and_ssh_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    plan = make_plan("pdsh", options={"ssh_port": 2222})
    (cmd,) = get_launcher("pdsh").bind(plan).commands
    assert list(cmd.argv[:-1]) == ["pdsh", "-R", "ssh", "-S", "-f", "32", "-w", "node1,node2"]
    remote = cmd.argv[-1]
    assert remote.count("%h") == 2 and "--node-host %h " in remote
    assert remote.startswith(
        f'ezd="${{TMPDIR:-/tmp}}"/elasticzero-env-ez-test-1-{plan.nonce}.%h && eze=$(cat -- "$ezd/env") && '
        'rm -f -- "$ezd/env" && rmdir -- "$ezd" && eval "$eze" && cd /work/dir && exec '
    )
    assert "INFO" not in remote and "NCCL_DEBUG" not in remote  # values (and names) travel over ssh's stdin
    assert cmd.env == {"PDSH_SSH_ARGS_APPEND": "-o BatchMode=yes -p 2222"}


def test_percent_in_user_data_is_escaped_for_pdsh() -> None:
    text = remote_command("ezd=X", "/d%n", ["p", "%u", "X"], host_placeholder="X")
    assert text.endswith("cd /d%%n && exec p %%u %h") and text.startswith("ezd=%h && ")


def test_launcher_args_go_before_the_remote_command() -> None:
    (cmd,) = get_launcher("pdsh").bind(make_plan("pdsh", launcher_args=("-u", "30"))).commands
    assert list(cmd.argv[-3:-1]) == ["-u", "30"]


def test_pdsh_options_are_declared_and_typed() -> None:
    backend = get_launcher("pdsh")
    defaults = {"ssh_port": None, "ssh_check": True, "save_pid": None, "max_node_restarts": 0}
    assert backend.resolve_options({}) == defaults
    typed = backend.resolve_options({"ssh_port": "2200", "ssh_check": "false"})
    assert (typed["ssh_port"], typed["ssh_check"]) == (2200, False)
    with pytest.raises(UsageError, match=r"launcher 'pdsh': option ssh_port='22x': expected int"):
        backend.resolve_options({"ssh_port": "22x"})
    with pytest.raises(UsageError, match=r"has no option 'per_rank' \(set by --per-rank\); valid options: max_node_"):
        backend.resolve_options({"per_rank": True}, {"per_rank": "--per-rank"})


def _stage_locally(plan: LaunchPlan, host: str, tmp: Path) -> None:
    """What ``ssh HOST <stage script>`` does on a node: the script under sh, the payload on its stdin."""
    p = subprocess.run(
        ["sh", "-c", stage_script(plan, host)], input=env_payload(job_env(plan)), env={"TMPDIR": str(tmp)},
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr


def test_env_file_through_real_sh_and_pdsh_arrives_byte_exact_and_is_removed(tmp_path: Path) -> None:
    require(shutil.which("pdsh") is not None, "pdsh not installed (run: bash tests/cluster/up.sh)")
    mark = tmp_path / "mark"
    mark.mkdir()
    hostile = [*HOSTILE, f"$(touch {mark}/a)", f"`touch {mark}/b`", f";touch {mark}/c"]
    env = {f"EZT_{i}": v for i, v in enumerate([*HOSTILE, f"x,y 'q' \"d\" $(touch {mark}/e)\nz %h %%", "\n\n"])}
    env["EZT_BYTES"] = os.fsdecode(b"\xff\xfe raw \x01")  # not UTF-8: must arrive as the same bytes
    cwd = tmp_path / "cwd $(touch ezpwn-cwd) `touch ezpwn-cwd` 'q' #x * %h\nl2"
    cwd.mkdir()
    plan = make_plan("pdsh", [("ha", [0]), ("hb", [0])], env=env, cwd=str(cwd))
    for host in ("ha", "hb"):
        _stage_locally(plan, host, tmp_path)
        d = tmp_path / f"elasticzero-env-{plan.job_id}-{plan.nonce}.{host}"
        assert (stat.S_IMODE(d.stat().st_mode), stat.S_IMODE((d / "env").stat().st_mode)) == (0o700, 0o600)
    with pytest.raises(AssertionError):  # a second stage never reuses what is there
        _stage_locally(plan, "ha", tmp_path)
    remote = remote_command(
        env_dir(plan, "HOSTSLOT"), str(cwd), [sys.executable, "-c", PROG, "HOSTSLOT", *hostile],
        host_placeholder="HOSTSLOT",
    )  # fmt: skip
    p = subprocess.run(
        ["pdsh", "-R", "exec", "-N", "-w", "ha,hb", "sh", "-c", remote],
        capture_output=True, timeout=60, check=False, env={**os.environ, "TMPDIR": str(tmp_path), "EZT_LEAK": "no"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    seen = sorted(json.loads(line) for line in p.stdout.splitlines())
    assert [s[2][0] for s in seen] == ["ha", "hb"]  # %h became each host's name
    for got_cwd, got_env, argv in seen:
        assert got_cwd == str(cwd)
        assert argv[1:] == hostile
        got = {k: os.fsencode(v) for k, v in got_env.items() if k != "EZT_LEAK"}
        assert got == {k: os.fsencode(v) for k, v in env.items()}
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted([cwd.name, "mark"])  # env files consumed
    assert list(mark.iterdir()) == []
    assert not any((d / "ezpwn-cwd").exists() for d in (tmp_path, Path.cwd(), Path.home()))


def test_unstage_script_removes_what_was_not_consumed(tmp_path: Path) -> None:
    plan = make_plan("pdsh", env={"HF_TOKEN": "s3cret"})
    _stage_locally(plan, "node1", tmp_path)
    for _ in range(2):  # idempotent: the second run finds nothing and still succeeds
        p = subprocess.run(["sh", "-c", unstage_script(plan, "node1")], env={"TMPDIR": str(tmp_path)}, check=False)
        assert p.returncode == 0
    assert list(tmp_path.iterdir()) == []


def test_dry_run_never_shows_a_secret_however_the_transport_rewrites_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    secrets = {"HF_TOKEN": "zq7%wx'vy", "DB_KEY": "qz"}  # quoting + %, and a value too short to search for
    plan = make_plan("pdsh", env={**secrets, "NCCL_DEBUG": "INFO"})
    bound = get_launcher("pdsh").bind(plan)
    outputs = [render_plan(bound), json.dumps(bound.to_json())]
    for out in outputs:
        for piece in ("zq7", "wx", "vy", "qz"):
            assert piece not in out, (piece, out)
    assert bound.to_json()["env"] == {"DB_KEY": "****", "HF_TOKEN": "****", "NCCL_DEBUG": "INFO"}
    # what runs (the very commands printed) carries no value at all: they go over ssh's stdin (stage)
    (real,) = bound.commands
    for piece in ("zq7", "wx", "vy", "qz", "INFO"):
        assert not any(piece in a for a in real.argv) and piece not in json.dumps(real.env)
    assert f"export HF_TOKEN={shlex.quote(secrets['HF_TOKEN'])}\n".encode() in env_payload(job_env(bound.plan))


FAKE_SSH = """#!{python}
import json, os, sys
host = sys.argv[-2]
with open(os.path.join({out!r}, host + ".json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "sid": os.getsid(0), "pgid": os.getpgid(0)}}, f)
if host == "bad1":
    sys.exit("ssh: connect to host bad1 port 2222: Connection refused")
sys.exit(3 if host == "bad2" else 0)
"""


def test_stop_job_uses_the_launch_ssh_options_own_session_and_names_failed_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    bindir, out = tmp_path / "bin", tmp_path / "out"
    bindir.mkdir()
    out.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(FAKE_SSH.format(python=sys.executable, out=str(out)))
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-F '/my ssh/config' -o User=bob")
    nodes = [("good", [0]), ("bad1", [0]), ("bad2", [0])]
    plan = make_plan("pdsh", nodes, options={"ssh_port": 2222}, launcher_args=("-l", "alice", "-u", "30"))
    backend = get_launcher("pdsh")
    bound = backend.bind(plan)
    backend.stop_job(bound)
    (launch,) = bound.commands
    expected = ["-l", "alice", *shlex.split(launch.env["PDSH_SSH_ARGS_APPEND"]), "-o", "ConnectTimeout=10"]
    assert expected[2:8] == ["-F", "/my ssh/config", "-o", "User=bob", "-o", "BatchMode=yes"]
    remote = f"{PY} -m elasticzero.agent.cli --kill-job ez-test-1"
    for host, _ in nodes:
        seen = json.loads((out / f"{host}.json").read_text())
        assert seen["argv"] == [*expected, host, remote]
        assert seen["sid"] != os.getsid(0) and seen["pgid"] != os.getpgid(0)  # out of the terminal's reach
    err = capfd.readouterr().err.splitlines()
    assert err == [
        "elasticzero-launch: could not stop job ez-test-1 on bad1: exit code 1: ssh: connect to host bad1 port "
        "2222: Connection refused (run elasticzero-run --kill-job there)",
        "elasticzero-launch: could not stop job ez-test-1 on bad2: exit code 3 (run elasticzero-run --kill-job there)",
    ]


def test_preflight_and_cleanup_share_the_ssh_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-i /k/id -o ConnectTimeout=3")
    plan = make_plan("pdsh", options={"ssh_port": 22})
    assert ssh_base(get_launcher("pdsh").bind(plan)) == [
        "ssh", "-i", "/k/id", "-o", "ConnectTimeout=3", "-o", "BatchMode=yes", "-p", "22", "-o", "ConnectTimeout=10"
    ]  # fmt: skip
    # a value the cleanup could not split is refused while the plan is bound, before anything starts
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-o 'unbalanced")
    with pytest.raises(UsageError, match=r"PDSH_SSH_ARGS_APPEND=\"-o 'unbalanced\" cannot be split: No closing"):
        get_launcher("pdsh").bind(plan)


def test_supervised_launch_runs_one_pdsh_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    plan = make_plan("pdsh", options={"max_node_restarts": 2})
    one, two = get_launcher("pdsh").bind(plan).commands
    assert (one.host, two.host) == ("node1", "node2")
    assert list(one.argv[:-1]) == ["pdsh", "-R", "ssh", "-S", "-f", "32", "-w", "node1"]
    assert list(two.argv[:-1]) == ["pdsh", "-R", "ssh", "-S", "-f", "32", "-w", "node2"]
    (fanout,) = get_launcher("pdsh").bind(replace(plan, options={})).commands
    assert one.argv[-1] == two.argv[-1] == fanout.argv[-1]  # the same remote command (%h: the host's -w name)
    assert one.env == two.env == fanout.env


RECORDING_SSH = """#!{python}
import json, os, sys
host = sys.argv[-2]
with open(os.path.join({out!r}, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"host": host, "remote": sys.argv[-1], "stdin": sys.stdin.read()}}) + "\\n")
sys.exit({code} if "mkdir" in sys.argv[-1] else 0)
"""


@pytest.mark.parametrize("code", [0, 1])
def test_restart_node_stops_that_node_then_stages_its_env_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(RECORDING_SSH.format(python=sys.executable, out=str(tmp_path), code=code))
    (bindir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    backend = get_launcher("pdsh")
    bound = backend.bind(make_plan("pdsh", options={"max_node_restarts": 1}))
    error = backend.restart_node(bound, "node2")  # type: ignore[attr-defined]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["host"] for c in calls] == ["node2"] * 3  # that host only
    kill = f"{PY} -m elasticzero.agent.cli --kill-job ez-test-1 --node-host node2"
    stage, unstage = stage_script(bound.plan, "node2"), unstage_script(bound.plan, "node2")
    assert [c["remote"] for c in calls] == [kill, unstage, stage]
    assert calls[2]["stdin"] == env_payload(job_env(bound.plan)).decode()
    assert error is None if code == 0 else error == f"exit code 1 ({stage[:200]})"
