"""execute() for a backend whose one command needs no live launcher: the launcher becomes the command (execve).

One small launcher script per case, run as a real process: the command it execs records its pid, working
directory, stdin and environment; the launcher's exit code is the command's own, and an unstartable command is
127 with one line. With ``--save-pid`` the launcher stays the parent (it must remove the file at exit), and so
does a library caller that did not ask for ``replace_process``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

LAUNCHER = """
import sys
from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero.launch.execute import execute
from elasticzero.launch.plan import AgentOptions, LaunchPlan, NodeSpec

RECORD = '''
import json, os, sys
json.dump({{"pid": os.getpid(), "cwd": os.getcwd(), "stdin": sys.stdin.read(), "x": os.environ.get("EZT_X")}},
          open(sys.argv[1], "w"))
sys.exit(7)
'''

class InPlace(LauncherBackend):
    name = "inplace"
    replaces_launcher = True
    def commands(self, plan):
        return [Command(argv=(sys.argv[1], "-c", RECORD, sys.argv[2]), env={{"EZT_X": "a b\\nc"}})]

plan = LaunchPlan(job_id="ez-exec-1", backend="inplace", nodes=(NodeSpec("localhost", 0, (0,)),),
                  master_addr="127.0.0.1", master_port=29500, entry=("noop.py",), cwd={cwd!r},
                  agent=AgentOptions(nnodes="1"), options={{"save_pid": sys.argv[3] or None}})
backend = InPlace()
sys.exit(execute(backend.bind(plan), backend, replace_process=sys.argv[4] == "exec"))
"""


def _launch(
    tmp_path: Path, python: str, save_pid: str = "", mode: str = "exec"
) -> tuple[subprocess.CompletedProcess[str], int, Path]:
    script, record = tmp_path / "launcher.py", tmp_path / "record.json"
    script.write_text(textwrap.dedent(LAUNCHER.format(cwd=str(tmp_path / "cwd"))))
    (tmp_path / "cwd").mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(script), python, str(record), save_pid, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate("typed into the launcher\n", timeout=90)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid, record


def test_launcher_becomes_the_command_and_a_failed_start_is_127(tmp_path: Path) -> None:
    p, pid, record = _launch(tmp_path, sys.executable)
    assert p.returncode == 7, p.stderr
    rec = json.loads(record.read_text())
    assert rec == {"pid": pid, "cwd": str(tmp_path / "cwd"), "stdin": "", "x": "a b\nc"}  # same pid: exec'd

    p, _, _ = _launch(tmp_path / "cwd", str(tmp_path / "no-such-python"))
    assert p.returncode == 127
    assert p.stderr.strip().startswith("elasticzero-launch: cannot start ") and "no-such-python" in p.stderr


def test_save_pid_or_a_library_caller_keeps_the_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "launcher.pid"
    p, pid, record = _launch(tmp_path, sys.executable, str(pid_file))
    assert p.returncode == 7, p.stderr
    assert json.loads(record.read_text())["pid"] != pid  # a child: the launcher stayed to remove the pid file
    assert not pid_file.exists()
    p, pid, record = _launch(tmp_path, sys.executable, mode="library")  # execute() without replace_process
    assert p.returncode == 7, p.stderr
    assert json.loads(record.read_text())["pid"] != pid
