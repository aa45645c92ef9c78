"""Splitting the command line into launcher flags and the user's entry, and the flag spellings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.args import build_parser, parse_args, split_entry


@pytest.mark.parametrize(
    ("argv", "flags", "entry"),
    [
        (["--dry-run", "train.py", "-i", "x"], ["--dry-run"], ["train.py", "-i", "x"]),
        (["--dry-run=json", "t.py"], ["--dry-run=json"], ["t.py"]),
        (["-H", "hf", "-iw0", "t.py"], ["-H", "hf", "-iw0"], ["t.py"]),
        (["--num_gpus", "2", "--", "--odd.py"], ["--num_gpus", "2"], ["--odd.py"]),
        (["--save-pid", "t.py"], ["--save-pid"], ["t.py"]),
        (["--save-pid=/run/x.pid", "t.py"], ["--save-pid=/run/x.pid"], ["t.py"]),
        (["--save_pid", "--", "odd.pid", "a"], ["--save_pid"], ["odd.pid", "a"]),
        (["--dry-run", "json", "s.py"], ["--dry-run", "json"], ["s.py"]),
        (["--dry_run", "text", "s.py", "json"], ["--dry_run", "text"], ["s.py", "json"]),
        (["--dry-run", "JSON", "s.py"], ["--dry-run"], ["JSON", "s.py"]),
        (["--dry-run", "json.py"], ["--dry-run"], ["json.py"]),
        (["--dry-run", "--", "json"], ["--dry-run"], ["json"]),
        (["--launcher-args", "-x FOO", "t.py"], ["--launcher-args", "-x FOO"], ["t.py"]),
        (["-m", "pkg.mod", "--a"], ["-m"], ["pkg.mod", "--a"]),
        ([], [], []),
    ],
)
def test_split_entry(argv: list[str], flags: list[str], entry: list[str]) -> None:
    assert split_entry(build_parser(), argv) == (flags, entry)


def test_flag_values_and_defaults() -> None:
    args, entry = parse_args(["--dry-run", "--save-pid=/tmp/p", "--export", "A", "--export", "B", "t.py"])
    assert (args.dry_run, args.save_pid, args.export, entry) == ("text", "/tmp/p", ["A", "B"], ["t.py"])
    args, _ = parse_args(["t.py"])
    assert (args.dry_run, args.save_pid, args.launcher_args, args.max_restarts) == (None, None, "", 0)


def test_dry_run_separate_value_is_parsed() -> None:
    args, entry = parse_args(["--dry-run", "json", "s.py", "--x"])
    assert (args.dry_run, entry) == ("json", ["s.py", "--x"])
    args, entry = parse_args(["--dry-run", "text", "s.py"])
    assert (args.dry_run, entry) == ("text", ["s.py"])


@pytest.mark.parametrize("flag", ["--save-pid", "--save_pid"])
def test_save_pid_with_a_separate_pid_path_is_an_error(flag: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_args([flag, "/run/ez.pid", "train.py"])
    assert str(err.value) == (
        f"{flag} takes its path only as {flag}=PATH: '/run/ez.pid' would run as the training script; "
        f"write {flag}=/run/ez.pid (or {flag} -- /run/ez.pid if that is the script)"
    )


def test_prefix_abbreviations_are_not_guessed() -> None:
    with pytest.raises(UsageError, match=r"unknown option '--num'"):
        parse_args(["--num", "2", "t.py"])


def test_console_script_dry_run_json(tmp_path: Path) -> None:
    exe = shutil.which("elasticzero-launch", path=str(Path(sys.executable).parent))
    assert exe is not None, "elasticzero-launch console script not installed in the venv"
    hf = tmp_path / "hf"
    hf.write_text("localhost slots=2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["HOME"] = str(tmp_path)
    p = subprocess.run(
        [exe, "-H", str(hf), "--launcher", "local", "--dry-run=json", "t.py", "a;b"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["nodes"] == [{"host": "localhost", "node_rank": 0, "slots": [0, 1]}]
    assert plan["commands"][0][-2:] == ["t.py", "a;b"]
    bad = subprocess.run([exe, "-H", str(tmp_path / "nope"), "t.py"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.startswith("elasticzero-launch: error: hostfile ")
    assert bad.stdout == ""
