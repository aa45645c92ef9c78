"""The agents' scratch folders: one naming rule, and the sweep of those a dead agent left (pure choice over a listing,
then a real folder tree)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from elasticzero.agent.agentdirs import agent_dir, make_private, remove_if_empty, stale, sweep
from elasticzero.agent.handoff import live_plan
from elasticzero.agent.hang import HangWatch
from elasticzero.agent.liveness import PeerPlan
from elasticzero.agent.progress import HangPlan, hang_plan
from elasticzero.errors import UsageError


def test_both_kinds_of_folder_follow_one_rule() -> None:
    env = {"TMPDIR": "/scratch"}
    assert agent_dir(env, "progress", "job1", 42) == "/scratch/elasticzero-progress-job1-42"
    assert agent_dir({}, "round", "job1", 42) == "/tmp/elasticzero-round-job1-42"
    assert hang_plan(None, env, "job1", 42).progress_dir == agent_dir(env, "progress", "job1", 42)
    plan = live_plan(True, "c10d", PeerPlan(4, 1, 4, "default"), env, "job1", 42)
    assert plan is not None and plan.round_dir == agent_dir(env, "round", "job1", 42)


def test_only_this_jobs_folders_of_dead_agents_are_stale() -> None:
    names = [
        "elasticzero-round-job1-10",  # dead agent of the job
        "elasticzero-progress-job1-10",
        "elasticzero-round-job1-11",  # live agent of the job
        "elasticzero-round-job1x-10",  # another job whose id starts the same
        "elasticzero-round-job2-10",  # another job
        "elasticzero-round-job1-notapid",
        "unrelated",
    ]
    assert stale(names, "job1", alive=lambda pid: pid == 11) == [
        "elasticzero-progress-job1-10",
        "elasticzero-round-job1-10",
    ]


def test_sweep_removes_the_dead_agents_folders_and_keeps_the_rest(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path)}
    dead = Path(agent_dir(env, "round", "job1", 999_999_999))  # above any pid: no such process
    mine = Path(agent_dir(env, "progress", "job1", os.getpid()))
    other = Path(agent_dir(env, "round", "job2", 999_999_999))
    for d in (dead, mine, other):
        d.mkdir()
        (d / "f").write_text("x")
    assert sweep(env, "job1") == 1
    assert not dead.exists() and mine.exists() and other.exists()
    assert sweep({"TMPDIR": str(tmp_path / "missing")}, "job1") == 0


def test_a_dead_agents_logs_folder_goes_only_where_it_holds_no_file(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path)}
    empty = Path(agent_dir(env, "logs", "job1", 999_999_998))  # a clean run's: the run's folder, nothing in it
    (empty / "job1" / "deeper").mkdir(parents=True)
    written = Path(agent_dir(env, "logs", "job1", 999_999_999))  # a failed worker's error file: the user's to read
    (written / "job1").mkdir(parents=True)
    (written / "job1" / "rank0.attempt0.error.json").write_text("{}")
    assert stale(os.listdir(tmp_path), "job1", alive=lambda pid: False) == [empty.name, written.name]
    assert sweep(env, "job1") == 1
    assert not empty.exists()
    assert (written / "job1" / "rank0.attempt0.error.json").read_text() == "{}"


def test_remove_if_empty(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert remove_if_empty(str(tmp_path / "a")) and not (tmp_path / "a").exists()
    (tmp_path / "c" / "d").mkdir(parents=True)
    (tmp_path / "c" / "d" / "f").write_text("x")
    assert not remove_if_empty(str(tmp_path / "c")) and (tmp_path / "c" / "d" / "f").exists()
    assert remove_if_empty(str(tmp_path / "missing"))  # gone already


def test_the_agents_logs_folder_is_its_users_alone(tmp_path: Path) -> None:
    own = tmp_path / "elasticzero-logs-job1-42"
    make_private(str(own))
    assert stat.S_IMODE(own.stat().st_mode) == 0o700  # what a job prints is not for every user of the node
    make_private(str(own))  # the same agent again (a rejoin): its own folder is taken as it is
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elasticzero-logs-job1-43"
    link.symlink_to(tmp_path / "elsewhere")  # put there by someone else, ahead of the agent
    with pytest.raises(UsageError, match=r"elasticzero-logs-job1-43 exists and is not a folder of this user's"):
        make_private(str(link))


def test_a_link_at_the_progress_folder_empties_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The hang watch empties its progress folder before each round: where a link stands at its path, the watch is
    off for the run (one line why) and the link's target keeps its files."""
    target = tmp_path / "someone-elses"
    target.mkdir()
    (target / "keep").write_text("x")
    link = Path(agent_dir({"TMPDIR": str(tmp_path)}, "progress", "job1", 42))
    link.symlink_to(target)
    HangWatch(HangPlan(True, None, str(link))).start()
    assert (target / "keep").read_text() == "x"
    assert "exists and is not a folder of this user's: remove it" in capsys.readouterr().err
