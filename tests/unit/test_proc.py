"""elasticzero.proc: the one home of the process rules, and a source scan that keeps it the only one."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticzero import proc
from elasticzero.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / "src" / "elasticzero" / "proc.py"

#: the child prints its own parent-death signal (prctl PR_GET_PDEATHSIG = 2)
PRINT_PDEATHSIG = (
    "import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")


def test_exit_codes_follow_the_shell() -> None:
    assert [proc.exit_status(c) for c in (0, 3, 255, -9, -15)] == [0, 3, 255, 137, 143]
    assert proc.signal_exit_code(signal.SIGINT) == 130 and proc.signal_exit_code(15) == 143


@pytest.mark.parametrize("job_id", ["job42", "ez-20261123T172716-ab12", "a", "A.b_c-d", "0" * 128, "none"])
def test_valid_job_ids(job_id: str) -> None:
    assert proc.check_job_id(job_id, "--rdzv-id") == job_id


@pytest.mark.parametrize("job_id", ["", "-x", ".x", "_x", "a;b", "a b", "a:b", "a/b", "$(id)", "x" * 129, "é"])
def test_invalid_job_ids_name_the_source_and_the_rule(job_id: str) -> None:
    with pytest.raises(UsageError) as err:
        proc.check_job_id(job_id, "--kill-job")
    assert str(err.value).startswith(f"--kill-job {job_id!r}: use letters, digits")


@linux
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_child_of_a_dead_parent_exits_before_running(sig: signal.Signals) -> None:
    preexec = proc.parent_death_preexec(sig, os.getpid() + 1_000_000)  # not our parent: "it already died"
    assert preexec is not None
    p = subprocess.run([sys.executable, "-c", "print('ran')"], preexec_fn=preexec, capture_output=True, timeout=30)
    assert (p.returncode, p.stdout) == (128 + sig, b"")


@linux
def test_preexec_arms_the_signal_in_the_child() -> None:
    preexec = proc.parent_death_preexec(signal.SIGTERM, os.getpid())
    p = subprocess.run([sys.executable, "-c", PRINT_PDEATHSIG], preexec_fn=preexec, capture_output=True, timeout=30)
    assert (p.returncode, p.stdout.strip()) == (0, str(int(signal.SIGTERM)).encode())


@linux
def test_arm_sets_the_calling_process_signal() -> None:
    code = f"from elasticzero.proc import arm_parent_death_signal as a; assert a({int(signal.SIGUSR1)}); "
    p = subprocess.run([sys.executable, "-c", code + PRINT_PDEATHSIG], capture_output=True, timeout=30)
    assert (p.returncode, p.stdout.strip()) == (0, str(int(signal.SIGUSR1)).encode()), p.stderr


#: a daemon thread blocked in a store call, whose store host ends once this interpreter is finalizing (``__main__``'s
#: names are cleared then; the object holds only builtins, as module globals may be gone): argv[1] says how to end
BLOCKED_AT_EXIT = """
import os, subprocess, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from elasticzero.proc import leave_if_threads_left
HOST = ("import os, sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)"
        "; print(s.port, flush=True); sys.stdin.read(); os._exit(0)")  # ends as its stdin closes
class HostEndsInFinalization:
    def __init__(self, host):
        self.close, self.pid, self.waitpid, self.sleep = host.stdin.close, host.pid, os.waitpid, time.sleep
    def __del__(self):
        self.close(); self.waitpid(self.pid, 0); self.sleep(2)  # the blocked call returns meanwhile
host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
client = dist.TCPStore("127.0.0.1", int(host.stdout.readline()), is_master=False, timeout=timedelta(seconds=60))
threading.Thread(target=client.get, args=("never set",), daemon=True).start()  # start() returns once it runs
time.sleep(0.2)  # it is in the call then (no function of __main__ may hold its names alive: they go at finalization)
ending = HostEndsInFinalization(host)
sys.exit(leave_if_threads_left(3) if sys.argv[1] == "leave" else 3)
"""


def _blocked_at_exit(how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKED_AT_EXIT, how], capture_output=True, text=True, timeout=120)


def test_a_thread_left_in_a_store_call_does_not_abort_the_exit() -> None:
    """The agent's end after a cut-off (``elasticzero-run``'s ``main``): its exit status, not SIGABRT."""
    left = _blocked_at_exit("leave")
    assert left.returncode == 3 and "terminate called" not in left.stderr, left.stderr[-2000:]


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 hangs such a thread instead of pthread_exit")
def test_the_plain_exit_with_that_thread_aborts() -> None:
    """The hazard :func:`~elasticzero.proc.leave_if_threads_left` avoids is real (else the test above shows nothing)."""
    plain = _blocked_at_exit("plain")
    assert plain.returncode == -signal.SIGABRT and "terminate called" in plain.stderr, plain.stderr[-2000:]


def test_the_last_thread_leaves_through_finalization() -> None:
    """Alone, the call returns (the status + 1 shows it did), and the interpreter ends as usual."""
    code = "import sys; from elasticzero.proc import leave_if_threads_left as leave; sys.exit(leave(5) + 1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 6


# --- the source scan: each rule is written once, in elasticzero/proc.py ----------------------------------------


def _sources() -> list[Path]:
    return sorted([*(REPO / "src").rglob("*.py"), *(REPO / "plugins").rglob("*.py")])


def _offences(tree: ast.AST) -> list[str]:
    """What in ``tree`` restates a rule of proc.py: prctl, the job-id name, a 128+signal sum, a job-id regex."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.Attribute) and getattr(node, "id", getattr(node, "attr", "")) in {
            "prctl",
            "PR_SET_PDEATHSIG",
        }:
            found.append(f"line {node.lineno}: parent-death signal set up here (use proc.parent_death_preexec/arm)")
        if isinstance(node, ast.Constant) and node.value in {proc.JOB_ID_ENV, proc.JOB_ID_PATTERN.pattern}:
            found.append(f"line {node.lineno}: {node.value!r} spelled here (import it from elasticzero.proc)")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            if any(isinstance(side, ast.Constant) and side.value == 128 for side in (node.left, node.right)):
                found.append(f"line {node.lineno}: a 128±signal exit code (use proc.exit_status/signal_exit_code)")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any("JOB_ID" in n.upper() for n in names) and ast.unparse(node.value.func).endswith("compile"):
                found.append(f"line {node.lineno}: a job-id pattern (use proc.check_job_id)")
    return found


def test_the_scan_sees_what_it_looks_for() -> None:
    sample = 'import re\nX = "ELASTICZERO_JOB_ID"\nrc = 128 + sig\n_JOB_ID = re.compile("x")\nlibc.prctl(1)\n'
    assert sorted(o.split(":")[0] for o in _offences(ast.parse(sample))) == ["line 2", "line 3", "line 4", "line 5"]
    assert _offences(ast.parse(HOME.read_text())) != []  # the home itself has them all


def test_process_rules_live_only_in_proc() -> None:
    offences = [
        f"{path.relative_to(REPO)} {o}"
        for path in _sources()
        if path != HOME
        for o in _offences(ast.parse(path.read_text()))
    ]
    assert offences == [], "process rules restated outside src/elasticzero/proc.py:\n" + "\n".join(offences)
