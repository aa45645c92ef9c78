"""execute(): real local processes; exit codes, 128+signal, --save-pid, env order, SIGTERM/SIGINT cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from plugin_plans import make_plan

from elasticzero.errors import UsageError
from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero.launch.execute import execute
from elasticzero.launch.plan import LaunchPlan


class Scripted(LauncherBackend):
    """A backend whose commands are given python snippets (real processes, no transport)."""

    name = "scripted"

    def __init__(self, *snippets: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.snippets, self.env, self.args, self.built = snippets, env or {}, args, 0

    def commands(self, plan: LaunchPlan) -> list[Command]:
        self.built += 1
        return [Command(argv=(sys.executable, "-c", s, *self.args), env=self.env) for s in self.snippets]


def run(plan: LaunchPlan, backend: LauncherBackend) -> int:
    """``plan`` bound to ``backend`` and executed, as ``elasticzero-launch`` does."""
    return execute(backend.bind(plan), backend)


def test_success_failure_and_signal_death(tmp_path: Path) -> None:
    plan = make_plan("scripted", cwd=str(tmp_path))
    assert run(plan, Scripted("pass", "pass")) == 0
    assert run(plan, Scripted("import sys; sys.exit(3)", "import time; time.sleep(0.5)")) == 3
    assert run(plan, Scripted("import os; os.kill(os.getpid(), 9)")) == 137


def test_what_runs_is_the_bound_commands_object(tmp_path: Path) -> None:
    out = tmp_path / "cmdline"
    snippet = f"open({str(out)!r}, 'wb').write(open('/proc/self/cmdline', 'rb').read())"
    backend = Scripted(snippet, args=("a b", "$(x)", "%h", "x\ny"))
    bound = backend.bind(make_plan("scripted", cwd=str(tmp_path)))
    assert execute(bound, backend) == 0
    (cmd,) = bound.commands
    assert out.read_bytes().split(b"\0")[:-1] == [os.fsencode(a) for a in cmd.argv]  # the process's own argv
    assert backend.built == 1  # built once, by bind: execute runs the bound commands, never rebuilds them


def test_cwd_env_order_and_save_pid(tmp_path: Path) -> None:
    pid_file = tmp_path / "launcher.pid"
    out = tmp_path / "out.json"
    snippet = (
        "import json,os; json.dump([os.getcwd(), list(os.environ)[-2:], os.environ['B'],"
        f" open({str(pid_file)!r}).read()], open({str(out)!r}, 'w'))"
    )
    plan = make_plan("scripted", cwd=str(tmp_path), options={"save_pid": str(pid_file)})
    assert run(plan, Scripted(snippet, env={"PATH": os.environ["PATH"], "B": "x\ny"})) == 0
    cwd, last, b, pid = json.loads(out.read_text())
    assert cwd == str(tmp_path) and last == ["PATH", "B"] and b == "x\ny"
    assert pid.strip() == str(os.getpid())
    assert not pid_file.exists()


@pytest.mark.parametrize("planted", ["file", "symlink", "dangling-symlink"])
def test_save_pid_never_reuses_or_follows_an_existing_path(tmp_path: Path, planted: str) -> None:
    pid_file, target, started = tmp_path / "launcher.pid", tmp_path / "victim", tmp_path / "started"
    if planted == "file":
        pid_file.write_text("4242\n")
    else:
        if planted == "symlink":
            target.write_text("precious\n")
        pid_file.symlink_to(target)
    plan = make_plan("scripted", cwd=str(tmp_path), options={"save_pid": str(pid_file)})
    with pytest.raises(UsageError, match="already exists"):
        run(plan, Scripted(f"open({str(started)!r}, 'w').close()"))
    assert not started.exists()  # nothing was started
    assert pid_file.is_symlink() or pid_file.read_text() == "4242\n"  # left as found, not removed
    assert (target.read_text() if target.exists() else None) == ("precious\n" if planted == "symlink" else None)


def test_save_pid_file_is_private(tmp_path: Path) -> None:
    pid_file, out = tmp_path / "launcher.pid", tmp_path / "mode"
    snippet = f"import os; open({str(out)!r}, 'w').write(oct(os.stat({str(pid_file)!r}).st_mode & 0o777))"
    plan = make_plan("scripted", cwd=str(tmp_path), options={"save_pid": str(pid_file)})
    assert run(plan, Scripted(snippet)) == 0
    assert out.read_text() == "0o600" and not pid_file.exists()


LAUNCHER = """
import os, sys, json
sys.path.insert(0, {tests!r})
from plugin_plans import make_plan
from elasticzero.errors import UsageError
from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero.launch.execute import execute

class Sleepy(LauncherBackend):
    name = "sleepy"
    def commands(self, plan):
        code = "import os,time; open(os.path.join({tmp!r}, 'child-%d' % os.getpid()), 'w').close(); time.sleep(300)"
        return [Command(argv=(sys.executable, "-c", code))] * 2
    def stop_job(self, bound):
        open(os.path.join({tmp!r}, "stop_job-called"), "w").close()

backend = Sleepy()
sys.exit(execute(backend.bind(make_plan("sleepy", cwd={tmp!r})), backend))
"""


def _start_launcher(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The LAUNCHER script as a real process, once both of its (sleeping) children are up."""
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(LAUNCHER.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))))
    proc = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("child-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc, [int(p.name.split("-")[1]) for p in tmp_path.glob("child-*")]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_signal_stops_everything(tmp_path: Path, sig: signal.Signals) -> None:
    proc, children = _start_launcher(tmp_path)
    try:
        assert len(children) == 2
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
        left = [pid for pid in children if not _gone(pid)]  # the launcher waited for them before exiting
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)  # the test failed: do not leave its sleepers behind
    assert (tmp_path / "stop_job-called").exists()
    assert left == []


def test_sigkilled_launcher_takes_its_commands_along(tmp_path: Path) -> None:
    proc, children = _start_launcher(tmp_path)
    try:
        assert len(children) == 2
        proc.kill()  # no handler runs: only the parent-death signal can stop the children
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in children if not _gone(pid)] == []
    finally:
        for pid in children:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
