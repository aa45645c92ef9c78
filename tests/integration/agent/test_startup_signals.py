"""elasticzero-run's start-up (torch's import, parsing): a stop signal exits 128+signal without a traceback.

``elasticzero-launch`` execs the agent for the local and no-ssh backends, so a Ctrl-C or SIGTERM meant for the
launcher can arrive before torch's agent handles signals. One interpreter runs every case in turn: a child per
signal that arms the start-up handlers and signals itself (delivered at once: no timing involved).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CASES = """
import os, signal, subprocess, sys
CHILD = '''
import os, signal, sys
from elasticzero.agent.cli import exit_on_stop_signals
exit_on_stop_signals(process=True)  # as the console script: the handler ends the process
os.kill(os.getpid(), int(sys.argv[1]))
print("still running")
'''
def start_as(num, disposition):
    # what the child inherits, set explicitly: pytest itself may run under nohup or as a background job (SIGHUP,
    # SIGINT, SIGQUIT ignored) or with signals blocked
    def preexec():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [num])
        signal.signal(num, disposition)
    return preexec
for sig in sys.argv[1:]:
    nohup = sig == "nohup"
    num = int(signal.SIGHUP if nohup else sig)
    p = subprocess.run([sys.executable, "-c", CHILD, str(num)], capture_output=True, text=True,
                       preexec_fn=start_as(num, signal.SIG_IGN if nohup else signal.SIG_DFL))
    print(sig, p.returncode, repr(p.stdout.strip()), repr(p.stderr.strip()))
"""


def test_stop_signal_during_startup_exits_128_plus_signal() -> None:
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    p = subprocess.run(
        [sys.executable, "-c", CASES, *(str(int(s)) for s in sigs), "nohup"],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    got = p.stdout.splitlines()
    assert got == [f"{int(s)} {128 + s} '' ''" for s in sigs] + ["nohup 0 'still running' ''"]  # nohup: ignored


def test_in_process_main_leaves_the_callers_handlers() -> None:
    from elasticzero.agent.cli import main

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main(["--kill-job", "bad id!"]) == 2
    assert {s: signal.getsignal(s) for s in before} == before
