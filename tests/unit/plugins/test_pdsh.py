"""pdsh: the one remote shell string, checked by running it through real pdsh (``-R exec``) and bash."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_plans import HOSTILE, PY, make_plan

from elasticzero.errors import UsageError
from elasticzero.launch.backend import get_launcher
from elasticzero.launch.cli import render_plan, shown_plan
from elasticzero_plugins.pdsh import remote_command, ssh_base
from ez_testing import require

PROG = "import json,os,sys; print(json.dumps([os.getcwd(), {k: v for k, v in os.environ.items() if k.startswith('EZT_')}, sys.argv[1:]]))"  # noqa: E501


def test_pdsh_argv_shape_and_ssh_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    (cmd,) = get_launcher("pdsh").commands(make_plan("pdsh", options={"ssh_port": 2222}))
    assert list(cmd.argv[:-1]) == ["pdsh", "-R", "ssh", "-S", "-f", "32", "-w", "node1,node2"]
    remote = cmd.argv[-1]
    assert remote.count("%h") == 1 and "--node-host %h " in remote
    assert remote.startswith("export NCCL_DEBUG=INFO; export ELASTICZERO_JOB_ID=ez-test-1; cd /work/dir && exec ")
    assert cmd.env == {"PDSH_SSH_ARGS_APPEND": "-o BatchMode=yes -p 2222"}


def test_percent_in_user_data_is_escaped_for_pdsh() -> None:
    text = remote_command({"V": "50%h"}, "/d%n", ["p", "%u", "X"], host_placeholder="X")
    assert text == "export V=50%%h; cd /d%%n && exec p %%u %h"


def test_launcher_args_go_before_the_remote_command() -> None:
    (cmd,) = get_launcher("pdsh").commands(make_plan("pdsh", launcher_args=("-u", "30")))
    assert list(cmd.argv[-3:-1]) == ["-u", "30"]


def test_remote_string_through_real_pdsh_and_bash(tmp_path: Path) -> None:
    require(shutil.which("pdsh") is not None, "pdsh not installed (run: bash tests/cluster/up.sh)")
    mark = tmp_path / "mark"
    mark.mkdir()
    hostile = [*HOSTILE, f"$(touch {mark}/a)", f"`touch {mark}/b`", f";touch {mark}/c"]
    env = {"EZT_A": "x,y 'q' \"d\" $(touch {m}/e)\nz %h %%".replace("{m}", str(mark)), "EZT_EMPTY": ""}
    cwd = tmp_path / "cwd $(touch ezpwn-cwd) `touch ezpwn-cwd` 'q' #x * %h\nl2"
    cwd.mkdir()
    remote = remote_command(
        env, str(cwd), [sys.executable, "-c", PROG, "HOSTSLOT", *hostile], host_placeholder="HOSTSLOT"
    )
    p = subprocess.run(
        ["pdsh", "-R", "exec", "-N", "-w", "ha,hb", "bash", "-c", remote],
        capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "EZT_LEAK": "no"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    seen = sorted(json.loads(line) for line in p.stdout.splitlines())
    assert [s[2][0] for s in seen] == ["ha", "hb"]  # %h became each host's name
    for got_cwd, got_env, argv in seen:
        assert got_cwd == str(cwd)
        assert argv[1:] == hostile
        assert {k: v for k, v in got_env.items() if k != "EZT_LEAK"} == env
    assert list(mark.iterdir()) == []
    assert not any((d / "ezpwn-cwd").exists() for d in (tmp_path, Path.cwd(), Path.home()))


def test_preflight_names_the_host_that_failed() -> None:
    require(shutil.which("ssh") is not None, "ssh client not installed")
    plan = make_plan("pdsh", [("no-such-host.invalid", [0])], options={"ssh_check": True})
    with pytest.raises(UsageError, match=r"passwordless ssh to 'no-such-host\.invalid' failed .*--no-ssh-check"):
        get_launcher("pdsh").preflight(plan)


def test_no_ssh_check_skips_preflight() -> None:
    plan = make_plan("pdsh", [("no-such-host.invalid", [0])], options={"ssh_check": False})
    get_launcher("pdsh").preflight(plan)  # nothing raised, nothing contacted


def test_dry_run_never_shows_a_secret_however_the_transport_rewrites_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # pdsh's remote string holds each value shell-quoted with % doubled: a text search for the raw value misses it
    monkeypatch.delenv("PDSH_SSH_ARGS_APPEND", raising=False)
    secrets = {"HF_TOKEN": "zq7%wx'vy", "DB_KEY": "qz"}  # quoting + %, and a value too short to search for
    plan = make_plan("pdsh", env={**secrets, "NCCL_DEBUG": "INFO"})
    backend = get_launcher("pdsh")
    shown = shown_plan(plan, backend)
    outputs = [render_plan(shown), json.dumps(shown.to_json())]
    for out in outputs:
        for piece in ("zq7", "wx", "vy", "qz"):
            assert piece not in out, (piece, out)
    (remote,) = [a for a in shown.commands[0].argv if a.startswith("export ")]
    assert "export HF_TOKEN='****'; export DB_KEY='****'; export NCCL_DEBUG=INFO;" in remote
    assert shown.to_json()["env"] == {"DB_KEY": "****", "HF_TOKEN": "****", "NCCL_DEBUG": "INFO"}
    # what runs is built from the real plan: the values are there, quoted for the remote shell and pdsh
    (real,) = backend.commands(plan)
    assert f"export HF_TOKEN={shlex.quote(secrets['HF_TOKEN'])}".replace("%", "%%") in real.argv[-1]


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
    (launch,) = backend.commands(plan)
    backend.stop_job(plan)
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
    assert ssh_base(plan) == [
        "ssh", "-i", "/k/id", "-o", "ConnectTimeout=3", "-o", "BatchMode=yes", "-p", "22", "-o", "ConnectTimeout=10"
    ]  # fmt: skip
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-o 'unbalanced")
    with pytest.raises(UsageError, match="PDSH_SSH_ARGS_APPEND"):
        ssh_base(plan)
