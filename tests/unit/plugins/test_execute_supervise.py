"""execute() under ``--max-node-restarts``: real local processes, one per node; a lost one started again."""

from __future__ import annotations

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
from elasticzero.launch.plan import BoundPlan, LaunchPlan

#: node1 trains until the job is over (``done`` exists), then finishes: exit 0
WAITS = "import os, time\nwhile not os.path.exists({done!r}): time.sleep(0.02)"
#: node2's n-th start (n counted in files): killed by SIGKILL while n <= {deaths}, else ends the job and exits {code}
DIES = """import os, signal
n = len([f for f in os.listdir({tmp!r}) if f.startswith('start-')]) + 1
open(os.path.join({tmp!r}, 'start-%d' % n), 'w').write(str(os.getpid()))
if n <= {deaths}:
    os.kill(os.getpid(), signal.SIGKILL)
open({done!r}, 'w').close()
raise SystemExit({code})"""
#: node1, ending the job (exit 0) once the node2 process that wrote {start} is dead and reaped (kill 0 fails)
LOST_FOR_GOOD = """import os, time
while not os.path.exists({start!r}) or not open({start!r}).read(): time.sleep(0.02)
pid = int(open({start!r}).read())
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.02)"""


class Nodes(LauncherBackend):
    """One python snippet per node (``Command.host`` set); ``restart_node`` records its calls and returns the next
    of ``prepare_errors`` (then None)."""

    name = "nodes"

    def __init__(self, snippets: dict[str, str], prepare_errors: tuple[str, ...] = ()) -> None:
        self.snippets, self.errors = snippets, list(prepare_errors)
        self.calls: list[str] = []

    def commands(self, plan: LaunchPlan) -> list[Command]:
        return [Command(argv=(sys.executable, "-c", code), host=host) for host, code in self.snippets.items()]

    def restart_node(self, bound: BoundPlan, host: str) -> str | None:
        self.calls.append(host)
        return self.errors.pop(0) if self.errors else None


def scripted(tmp: Path, deaths: int, code: int = 0, errors: tuple[str, ...] = ()) -> Nodes:
    done = str(tmp / "done")
    return Nodes({"node1": WAITS.format(done=done), "node2": DIES.format(tmp=str(tmp), done=done, deaths=deaths,
                                                                        code=code)}, errors)  # fmt: skip


def run(tmp: Path, backend: Nodes, budget: int) -> int:
    plan = make_plan("nodes", cwd=str(tmp), options={"max_node_restarts": budget})
    return execute(backend.bind(plan), backend)


def starts(tmp: Path) -> int:
    return len(list(tmp.glob("start-*")))


def test_a_killed_node_is_started_again_and_the_job_finishes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    backend = scripted(tmp_path, deaths=1)
    assert run(tmp_path, backend, budget=2) == 0
    assert backend.calls == ["node2"] and starts(tmp_path) == 2
    assert capsys.readouterr().err.splitlines() == [
        "elasticzero-launch: node2's agent ended (exit 137: the agent was killed by SIGKILL); starting it again in "
        "1 s (node restart 1 of 2)"
    ]


def test_past_the_budget_the_job_goes_on_without_the_node(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    backend = scripted(tmp_path, deaths=5)
    # node1 finishes the job once node2's second start is dead and reaped: the launcher reaps and decides in one
    # step, so the decision on that loss is made before node1's exit can be seen
    backend.snippets["node1"] = LOST_FOR_GOOD.format(start=str(tmp_path / "start-2"))
    assert run(tmp_path, backend, budget=1) == 0  # the job finished on node1: a node lost for good does not fail it
    assert backend.calls == ["node2"] and starts(tmp_path) == 2
    err = capsys.readouterr().err
    assert "no node restarts left (--max-node-restarts 1): the job goes on without it" in err


def test_a_host_not_ready_yet_is_tried_again_without_spending_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    backend = scripted(tmp_path, deaths=1, errors=("exit code 255: ssh: connect to host node2: No route to host",))
    assert run(tmp_path, backend, budget=1) == 0
    assert backend.calls == ["node2", "node2"] and starts(tmp_path) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == (
        "elasticzero-launch: cannot start node2's agent again yet: exit code 255: ssh: connect to host node2: "
        "No route to host; next try in 2 s"
    )


def test_the_jobs_failure_is_not_restarted(tmp_path: Path) -> None:
    backend = scripted(tmp_path, deaths=0, code=3)  # node2 fails the job at once; node1 then finishes
    assert run(tmp_path, backend, budget=2) == 3
    assert backend.calls == [] and starts(tmp_path) == 1


def test_the_option_is_refused_where_a_node_cannot_be_restarted() -> None:
    class Fanout(LauncherBackend):
        name = "fanout"

        def commands(self, plan: LaunchPlan) -> list[Command]:
            return [Command(argv=("true",))]

    with pytest.raises(UsageError, match=r"^--max-node-restarts: launcher 'fanout' cannot start one node's agent"):
        Fanout().bind(make_plan("fanout", options={"max_node_restarts": 1}))
    with pytest.raises(UsageError, match=r"^--max-node-restarts -1: must be >= 0$"):
        Nodes({}).bind(make_plan("nodes", options={"max_node_restarts": -1}))
    assert Fanout().bind(make_plan("fanout")).plan.options["max_node_restarts"] == 0  # the default: off


SUPERVISED_LAUNCHER = """
import os, sys
sys.path.insert(0, {tests!r})
from plugin_plans import make_plan
from elasticzero.launch.backend import Command, LauncherBackend
from elasticzero.launch.execute import execute

class Sleepy(LauncherBackend):
    name = "sleepy"
    def commands(self, plan):
        code = "import os,time; open(os.path.join({tmp!r}, 'child-%d' % os.getpid()), 'w').close(); time.sleep(300)"
        return [Command(argv=(sys.executable, "-c", code), host=n.host) for n in plan.nodes]
    def restart_node(self, bound, host):
        return None
    def stop_job(self, bound):
        open(os.path.join({tmp!r}, "stop_job-called"), "w").close()

backend = Sleepy()
sys.exit(execute(backend.bind(make_plan("sleepy", cwd={tmp!r}, options={{"max_node_restarts": 3}})), backend))
"""


def test_a_stop_signal_stops_every_node_and_restarts_none(tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(SUPERVISED_LAUNCHER.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("child-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [int(p.name.split("-")[1]) for p in tmp_path.glob("child-*")]
    try:
        assert len(children) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    assert (tmp_path / "stop_job-called").exists()
    assert len(list(tmp_path.glob("child-*"))) == 2  # the stopped nodes were not started again
    assert "Traceback" not in err and "starting it again" not in err, err
