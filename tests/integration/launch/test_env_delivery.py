"""pdsh's environment delivery over real ssh to the namespace hosts: the private env file, its refusal to reuse
anything already there, its removal, and the argv scanner the real-launch tests rely on.

The full path (stage → pdsh → agent → ranks, every argv scanned on every host) runs in
``test_real_launch.py::test_agent_per_node_hostile_strings[pdsh]``.
"""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from launchkit import ArgvWatch
from test_real_launch import bed

from elasticzero.errors import UsageError
from elasticzero.launch.backend import get_launcher
from elasticzero.launch.plan import AgentOptions, LaunchPlan, NodeSpec

pytestmark = [pytest.mark.pdsh, pytest.mark.sshd, pytest.mark.timeout(120)]


def _plan(hosts: list[str], env: dict[str, str]) -> LaunchPlan:
    return LaunchPlan(
        job_id=f"ezt-env-{secrets.token_hex(4)}",
        backend="pdsh",
        nodes=tuple(NodeSpec(h, i, (0,)) for i, h in enumerate(hosts)),
        master_addr=hosts[0],
        master_port=29500,
        entry=("t.py",),
        cwd="/",
        agent=AgentOptions(nnodes=str(len(hosts)), python=sys.executable),
        env=env,
    )


def _env_dirs(plan: LaunchPlan) -> list[Path]:
    """The plan's env directories in /tmp (the namespace hosts share this machine's file system)."""
    return sorted(Path("/tmp").glob(f"elasticzero-env-{plan.job_id}-{plan.nonce}.*"))


def test_stage_writes_a_private_file_per_host_refuses_reuse_and_unstage_removes_it() -> None:
    _tb, hosts = bed("pdsh")
    value = "v 'q' \"d\" $(touch /tmp/ez-pwn) %h\nline2\n"
    plan = _plan(hosts, {"HF_TOKEN": value})
    backend = get_launcher("pdsh")
    bound = backend.bind(plan)
    try:
        backend.stage(bound)
        dirs = _env_dirs(plan)
        assert [d.name.rsplit(".", 1)[1] for d in dirs] == sorted(hosts)
        for d in dirs:
            assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE((d / "env").stat().st_mode) == 0o600
            assert (d / "env").stat().st_uid == os.getuid()
        with pytest.raises(UsageError, match=r"cannot deliver the environment to '(node\d)' over ssh \(exit code 1"):
            backend.stage(bound)  # mkdir refuses what is already there: a stale or planted directory is never used
        check = subprocess.run(
            ["sh", "-c", 'eval "$(cat -- "$1")"; printf %s "$HF_TOKEN"', "sh", str(dirs[0] / "env")],
            capture_output=True, timeout=30, check=True,
        )  # fmt: skip
        assert check.stdout == value.encode()
    finally:
        backend.unstage(bound)
    assert _env_dirs(plan) == []
    assert not Path("/tmp/ez-pwn").exists()


def test_an_unreachable_host_is_named_and_nothing_stays_behind(capfd: pytest.CaptureFixture[str]) -> None:
    _tb, hosts = bed("pdsh")
    plan = _plan([hosts[0], "ez-no-such-host"], {"HF_TOKEN": "x"})
    backend = get_launcher("pdsh")
    bound = backend.bind(plan)
    with pytest.raises(UsageError, match="cannot deliver the environment to 'ez-no-such-host'"):
        backend.stage(bound)
    backend.unstage(bound)  # what execute() does when the run did not succeed
    assert _env_dirs(plan) == []
    assert "could not remove the job's env file on ez-no-such-host" in capfd.readouterr().err


def test_argv_watch_sees_a_value_in_a_namespace_hosts_argv() -> None:
    """Control for the real-launch scans: a process on a namespace host with the value in its argv is found."""
    tb, _ = bed("pdsh")
    needle = f"s3cr3t{secrets.token_hex(8)}"
    proc = subprocess.Popen(
        ["ip", "netns", "exec", tb.netns[0], sys.executable, "-c", "import sys; sys.stdin.read()", needle],
        stdin=subprocess.PIPE,
    )
    try:
        with ArgvWatch([needle.encode()]) as watch:
            while not watch.hits:
                watch.scan()  # the process exists as soon as Popen returned; a few scans find its argv
    finally:
        proc.communicate(b"", timeout=30)
    assert {pid for pid, _ in watch.hits} >= {proc.pid}
