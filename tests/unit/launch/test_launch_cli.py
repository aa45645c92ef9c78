"""``elasticzero-launch`` end to end through ``main()``: plans, dry-run output, execution hand-off, and every
bad input → one ``elasticzero-launch: error: …`` line, exit code 2, nothing launched."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from elasticzero.launch import resources
from elasticzero.launch.args import parse_args
from elasticzero.launch.cli import build_plan, main

Executions = Any  # the launch_env fixture (conftest.Executions): recorded execute() calls
HOSTILE_ARGS = ["--foo;rm -rf /", "$(touch /tmp/x)", "`id`", "a b", "'q'", '"dq"', "#c", "*", "x\ny", "--", "-i"]


def _hostfile(path: Path, text: str = "w0 slots=2\nw1 slots=2\nw2 slots=1\n") -> str:
    path.write_text(text)
    return str(path)


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], launched: Executions) -> str:
    """Run ``main(argv)``, expect exit 2 and one error line; return the message after the prefix."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("elasticzero-launch: error: ")
    assert launched.calls == []
    return lines[0].removeprefix("elasticzero-launch: error: ")


def test_dry_run_json_plan(launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hf = _hostfile(tmp_path / "hf")
    plan = _json(capsys, ["-H", hf, "-e", "w1:0", "--launcher", "fake", "--dry-run=json", "train.py", "--lr", "1"])
    assert plan["backend"] == "fake"
    assert plan["nodes"] == [
        {"host": "w0", "node_rank": 0, "slots": [0, 1]},
        {"host": "w1", "node_rank": 1, "slots": [1]},
        {"host": "w2", "node_rank": 2, "slots": [0]},
    ]
    assert plan["world_size"] == 4
    assert (plan["master_addr"], plan["master_port"]) == ("w0", 29500)
    assert re.fullmatch(r"ez-\d{14}-[0-9a-f]{8}", plan["job_id"])
    assert len(plan["commands"]) == 3
    for rank, cmd in enumerate(plan["commands"]):
        assert all(isinstance(x, str) for x in cmd)
        assert cmd[-3:] == ["train.py", "--lr", "1"]
        assert cmd[cmd.index("--node-rank") + 1] == str(rank)
        assert cmd[cmd.index("--rdzv-id") + 1] == plan["job_id"]
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == "w0:29500"
    assert launch_env.calls == []


def test_dry_run_masks_secrets(launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    plan = _json(capsys, ["--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["env"] == {"HF_TOKEN": "****", "NCCL_DEBUG": "INFO"}
    assert main(["--launcher", "fake", "--dry-run", "t.py"]) == 0
    text = capsys.readouterr().out
    assert "HF_TOKEN=****" in text
    assert "EZ_T_TOKEN=****" in text  # a backend's per-command env is masked too
    assert "NCCL_DEBUG=INFO" in text
    assert "hf_supersecret" not in text
    assert launch_env.calls == []


def test_a_backend_putting_a_secret_value_in_an_argv_is_refused(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    plan = _json(capsys, ["--launcher", "fake-inline", "--dry-run=json", "t.py"])
    assert "NCCL_DEBUG=INFO" in plan["commands"][0]  # not secret: shown as it runs
    for value in ("wandb-secret-value", "1"):  # a value too short to search for is caught all the same
        monkeypatch.setenv("WANDB_API_KEY", value)
        for dry in (["--dry-run"], ["--dry-run=json"], []):
            msg = _error(capsys, ["--launcher", "fake-inline", *dry, "t.py"], launch_env)
            assert msg == (
                "launcher 'fake-inline' puts the value of WANDB_API_KEY in a command line, where every user of the "
                "host can read it; the backend must pass it by name (Command.env) or stage it on the nodes"
            )


def test_dry_run_text_shows_hosts_slots_and_quoted_commands(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hf = _hostfile(tmp_path / "hf")
    assert main(["-H", hf, "-i", "w0@w2", "--launcher", "fake", "--dry-run", "train.py", "a;b"]) == 0
    out = capsys.readouterr().out
    assert "dry run; nothing started" in out
    assert re.search(r"^\s+0\s+w0\s+slots 0,1$", out, re.M)
    assert re.search(r"^\s+1\s+w2\s+slots 0$", out, re.M)
    cmd_lines = [line for line in out.splitlines() if "elasticzero.agent.cli" in line]
    assert len(cmd_lines) == 2
    argv = shlex.split(cmd_lines[0].split("] ", 1)[1])
    assert argv[0] == "EZ_T_TOKEN=****"
    assert argv[-2:] == ["train.py", "a;b"]
    assert launch_env.calls == []


def test_user_arguments_pass_untouched(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    entry = ["train.py", "--hostfile", "x", *HOSTILE_ARGS, "--dry-run"]
    plan = _json(capsys, ["--launcher", "fake", "--dry-run=json", *entry])
    assert plan["commands"][0][-len(entry) :] == entry


def test_double_dash_separates_the_script(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _json(capsys, ["--launcher=fake", "--dry-run=json", "--", "-weird-name.py", "-i", "x"])
    assert plan["commands"][0][-3:] == ["-weird-name.py", "-i", "x"]


def test_execute_gets_the_plan_and_its_exit_code(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import ez_fake_backend  # type: ignore[import-not-found]

    launch_env.rc = 7
    hf = _hostfile(tmp_path / "hf")
    assert main(["-H", hf, "--num-nodes", "2", "--launcher", "fake", "train.py"]) == 7
    [(bound, backend)] = launch_env.calls
    assert backend.name == "fake"
    assert [n.host for n in bound.plan.nodes] == ["w0", "w1"]
    assert len(bound.commands) == 2
    # built once, then the preflight and execute get that very bound plan
    assert ez_fake_backend.CALLS == [("commands", bound.plan.job_id), ("preflight", bound)]
    assert ez_fake_backend.CALLS[1][1] is bound


def test_deepspeed_spellings(launch_env: Executions, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path / "hf")
    argv = [
        "--hostfile", hf, "--num_nodes", "2", "--num_gpus", "1", "--master_addr", "10.0.0.9", "--master_port", "1234",
        "--launcher", "fake", "--launcher_args", "-x FOO --mca 'a b'", "--no_ssh_check", "--save_pid",
        "--bind_cores_to_rank", "--no_python", "--no_local_rank", "--log_dir", "logs", "--ssh_port", "2222",
        "--max_restarts", "3", "--force_multi", "--rdzv_conf", "join_timeout=5", "prog", "--x",
    ]  # fmt: skip
    args, entry = parse_args(argv)
    plan = build_plan(args, entry, {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)}, str(tmp_path))
    assert [(n.host, n.slots) for n in plan.nodes] == [("w0", (0,)), ("w1", (0,))]
    assert (plan.master_addr, plan.master_port) == ("10.0.0.9", 1234)
    assert plan.launcher_args == ("-x", "FOO", "--mca", "a b")
    assert plan.options["ssh_check"] is False
    assert plan.options["ssh_port"] == 2222
    assert plan.options["save_pid"] == ""  # bare flag: the default path is made only when the plan executes
    assert plan.agent.bind_cores_to_rank and plan.agent.no_python
    assert plan.agent.log_dir == str(tmp_path / "logs")
    assert plan.agent.max_restarts == 3
    assert plan.agent.rdzv_conf == (("join_timeout", "5"),)
    assert plan.entry == ("prog", "--x")


def test_short_and_attached_forms(launch_env: Executions, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path / "hf")
    for argv in (["-H", hf, "-iw1:1", "t.py"], [f"--hostfile={hf}", "--include=w1:1", "t.py"]):
        args, entry = parse_args(argv)
        plan = build_plan(args, entry, {}, str(tmp_path))
        assert [(n.host, n.slots) for n in plan.nodes] == [("w1", (1,))]


def test_default_launcher_local_for_one_node_pdsh_for_many(launch_env: Executions, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path / "hf")
    one = build_plan(*parse_args(["-H", hf, "-i", "w1", "t.py"]), {}, str(tmp_path))
    many = build_plan(*parse_args(["-H", hf, "t.py"]), {}, str(tmp_path))
    forced = build_plan(*parse_args(["-H", hf, "-i", "w1", "--force-multi", "t.py"]), {}, str(tmp_path))
    assert (one.backend, many.backend, forced.backend) == ("local", "pdsh", "pdsh")
    assert one.master_addr == "w1"


def test_localhost_cpu_uses_nproc_per_node(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _json(capsys, ["--nproc-per-node", "3", "--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["nodes"] == [{"host": "localhost", "node_rank": 0, "slots": [0, 1, 2]}]
    assert plan["master_addr"] == "127.0.0.1"


def test_cuda_visible_devices_restricts_local_slots(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resources, "detect_gpu_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    plan = _json(capsys, ["--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["nodes"] == [{"host": "localhost", "node_rank": 0, "slots": [1, 3]}]
    assert "CUDA_VISIBLE_DEVICES" not in plan["env"]


def test_slurm_allocation_without_hostfile(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3)")
    plan = _json(capsys, ["-e", "node2", "--launcher", "fake", "--dry-run=json", "t.py"])
    assert [(n["host"], n["slots"]) for n in plan["nodes"]] == [("node1", [0, 1]), ("node3", [0, 1])]
    assert plan["master_addr"] == "node1"


def test_elastic_nnodes_and_no_ssh(launch_env: Executions, tmp_path: Path) -> None:
    hf = _hostfile(tmp_path / "hf")
    plan = build_plan(*parse_args(["-H", hf, "--nnodes", "2:4", "t.py"]), {}, str(tmp_path))
    assert plan.agent.nnodes == "2:4"
    plan = build_plan(*parse_args(["-H", hf, "--no-ssh", "--node-rank", "2", "t.py"]), {}, str(tmp_path))
    assert (plan.backend, plan.options["node_rank"]) == ("no-ssh", 2)


def test_ipv6_master_addr_is_bracketed_in_the_endpoint(launch_env: Executions, tmp_path: Path) -> None:
    plan = build_plan(*parse_args(["--master-addr", "[FE80::1]", "t.py"]), {}, str(tmp_path))
    assert plan.master_addr == "fe80::1"
    argv = plan.agent_argv(["--node-rank", "0"])
    assert argv[argv.index("--rdzv-endpoint") + 1] == "[fe80::1]:29500"


def test_job_ids_are_unique(launch_env: Executions, tmp_path: Path) -> None:
    ids = {build_plan(*parse_args(["t.py"]), {}, str(tmp_path)).job_id for _ in range(20)}
    assert len(ids) == 20


def test_hostile_working_directory_is_kept_exactly(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hostile = tmp_path / "a;echo PWNED $(x) `y` 'q' #"
    hostile.mkdir()
    monkeypatch.chdir(hostile)
    plan = _json(capsys, ["--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["cwd"] == str(hostile)


def test_help_exits_zero(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--num_gpus" in out
    assert "--include" in out


def test_missing_program_is_a_note_in_dry_run_and_an_error_otherwise(
    launch_env: Executions, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--launcher", "fake-missing", "--dry-run=json", "t.py"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["backend"] == "fake-missing"
    assert "needs 'ez-no-such-program-anywhere' on PATH" in captured.err
    msg = _error(capsys, ["--launcher", "fake-missing", "t.py"], launch_env)
    assert msg.startswith("launcher 'fake-missing' needs 'ez-no-such-program-anywhere' on PATH")


def test_dry_run_json_with_the_local_backend(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("elasticzero_plugins.local") is None:
        pytest.skip("plugins/elasticzero_plugins/local.py not written yet")
    plan = _json(capsys, ["--nproc-per-node", "2", "--launcher", "local", "--dry-run=json", "t.py", "a;b"])
    assert plan["backend"] == "local"
    assert plan["nodes"] == [{"host": "localhost", "node_rank": 0, "slots": [0, 1]}]
    assert plan["commands"] and all(isinstance(a, str) for c in plan["commands"] for a in c)
    assert plan["commands"][0][-2:] == ["t.py", "a;b"]
    assert launch_env.calls == []


BAD_HOSTFILE_CASES = [
    ("w0 slots=2\nw0 slots=1\n", ":2: duplicate host 'w0' (first at line 1)"),
    ("w0 slots=0\n", ":1: slots=0 must be a positive integer"),
    ("w0 slots=-1\n", ":1: slots=-1 must be a positive integer"),
    ("w0 slots=x\n", ":1: slots='x' is not a number"),
    ("w0 slots=1 cpus=2\n", ":1: unknown key 'cpus'"),
    ("# nothing\n", ": hostfile has no hosts"),
    ("w0 slots=1\nthis is garbage\n", ":2: unexpected 'is'"),
    ("bob@w0 slots=1\n", ":1: 'user@host' is not supported"),
]


@pytest.mark.parametrize(("text", "words"), BAD_HOSTFILE_CASES)
def test_bad_hostfile_exit_2(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, words: str
) -> None:
    hf = _hostfile(tmp_path / "hf", text)
    msg = _error(capsys, ["-H", hf, "--launcher", "fake", "t.py"], launch_env)
    assert msg.startswith(hf + words)


BAD_FLAG_CASES = [
    (["-i", "w0", "-e", "w1"], "--include and --exclude cannot be combined; use one of them"),
    (["-i", "w9"], "--include 'w9': unknown host 'w9'; hostfile {hf} has: w0, w1, w2"),
    (["-e", "w9:0"], "--exclude 'w9:0': unknown host 'w9'"),
    (["-i", "w2:1"], "--include 'w2:1': host 'w2' has no slot 1; its slots are 0 (hostfile {hf})"),
    (["-i", "[fe80::1]"], "--include '[fe80::1]': unknown host 'fe80::1'"),
    (["-i", "fe80::1"], "--include 'fe80::1': IPv6 hosts must be bracketed in filters"),
    (["--num-gpus", "2"], "--num-gpus 2 but host 'w2' has only 1 slot(s)"),
    (["-i", "w0:1", "--num_gpus", "2"], "--num-gpus 2 but host 'w0' has only 1 slot(s)"),
    (["--num-nodes", "4"], "--num-nodes 4 but only 3 host(s) available"),
    (["-i", "w0", "--num-nodes", "2"], "--num-nodes 2 but only 1 host(s) available"),
    (["--num-nodes", "0"], "argument --num-nodes/--num_nodes: '0' must be at least 1"),
    (["--num-gpus", "x"], "argument --num-gpus/--num_gpus/"),
    (["--bogus"], "unknown option '--bogus'; see elasticzero-launch --help"),
    (["--num_gpu", "1"], "unknown option '--num_gpu'"),
    (["--autotuning", "best"], "argument --autotuning: invalid choice: 'best'"),
    (["--min_elastic_nodes", "1"], "--min_elastic_nodes is not supported: use --nnodes MIN:MAX"),
    (["--launcher", "bogus"], "unknown --launcher 'bogus'; available: "),
    (["--no-ssh"], "--no-ssh needs --node-rank R"),
    (["--no-ssh", "--node-rank", "3"], "--node-rank 3 but the plan has 3 node(s) (ranks 0-2)"),
    (["--node-rank", "1"], "--node-rank only applies with --no-ssh"),
    (["--no-ssh", "--node-rank", "0", "--launcher", "pdsh"], "--no-ssh contradicts --launcher pdsh"),
    (["--launcher", "local"], "--launcher local runs on this machine but 3 nodes are selected"),
    (["--nnodes", "2"], "--nnodes 2 contradicts the 3 node(s) selected"),
    (["--nnodes", "4:5"], "--nnodes 4:5 contradicts the 3 node(s) selected"),
    (["--nnodes", "3:1"], "--nnodes '3:1': need 1 <= MIN <= MAX"),
    (["--nnodes", "a"], "--nnodes 'a': expected N or MIN:MAX"),
    (["--module", "--no-python"], "--module and --no-python cannot be combined"),
    (["--master-addr", "a;b"], "--master-addr: invalid host name 'a;b'"),
    (["--master-addr=-oX"], "--master-addr: host name '-oX' starts with '-'"),
    (["--master-port", "70000"], "argument --master-port/--master_port: '70000' is not a TCP port"),
    (["--dry-run=xml"], "argument --dry-run/--dry_run: invalid choice: 'xml'"),
    (["--rdzv-conf", "oops"], "--rdzv-conf 'oops': bad item 'oops'"),
    (["--rdzv-id", "a;b"], "--rdzv-id 'a;b': use letters, digits"),
    (["--export", "EZ_UNSET_VAR_X"], "--export EZ_UNSET_VAR_X: EZ_UNSET_VAR_X is not set"),
    (["--export", "RANK"], "--export RANK: set per rank by the agent"),
    (["--export-prefix", "A-"], "--export-prefix 'A-'"),
    (["--hostfile"], "argument -H/--hostfile: expected one argument"),
]


@pytest.mark.parametrize(("flags", "words"), BAD_FLAG_CASES)
def test_bad_flags_exit_2(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], words: str
) -> None:
    hf = _hostfile(tmp_path / "hf")
    argv = ["-H", hf, *flags] if "--hostfile" not in flags else flags
    if "--launcher" not in flags and "--no-ssh" not in flags:
        argv += ["--launcher", "fake"]
    msg = _error(capsys, [*argv, "--dry-run", "t.py"] if "-H" in argv else [*argv], launch_env)
    assert msg.startswith(words.format(hf=hf)), msg


def test_unknown_launcher_lists_the_available_ones(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    msg = _error(capsys, ["--launcher", "bogus", "t.py"], launch_env)
    for name in ("fake", "local", "pdsh", "openmpi", "slurm"):
        assert name in msg


def test_missing_script(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    assert _error(capsys, ["--launcher", "fake"], launch_env).startswith("missing training script")
    assert _error(capsys, ["--launcher", "fake", "--"], launch_env).startswith("missing training script")


def test_missing_explicit_hostfile(launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    msg = _error(capsys, ["-H", str(tmp_path / "nope"), "t.py"], launch_env)
    assert msg == f"hostfile '{tmp_path / 'nope'}' not found; fix the path or omit --hostfile to run on localhost"


def test_bad_env_file_names_file_and_line(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (Path.cwd() / ".elasticzero_env").write_text("# ok\nGOOD=1\n9BAD=2\n")
    msg = _error(capsys, ["--launcher", "fake", "t.py"], launch_env)
    assert msg.startswith(f"{Path.cwd() / '.elasticzero_env'}:3: invalid variable name '9BAD'")


def test_env_file_values_reach_the_plan_exactly(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (Path.cwd() / ".deepspeed_env").write_text("export MY_VAR='a;echo PWNED $(x) `y` \"q\" #'\n")
    plan = _json(capsys, ["--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["env"]["MY_VAR"] == 'a;echo PWNED $(x) `y` "q" #'


# --- optional flag values never swallow the script ------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--save-pid", "--save_pid"])
def test_save_pid_with_a_separate_path_is_an_error_not_the_script(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str
) -> None:
    pid = tmp_path / "ez.pid"
    msg = _error(capsys, ["--launcher", "fake", flag, str(pid), "train.py"], launch_env)
    assert msg == (
        f"{flag} takes its path only as {flag}=PATH: {str(pid)!r} would run as the training script; "
        f"write {flag}={pid} (or {flag} -- {pid} if that is the script)"
    )


def test_save_pid_path_with_equals_and_bare_flag(launch_env: Executions, tmp_path: Path) -> None:
    pid = tmp_path / "ez.pid"
    assert main(["--launcher", "fake", f"--save-pid={pid}", "train.py", "--lr", "1"]) == 0
    assert main(["--launcher", "fake", "--save-pid", "--", "odd.pid"]) == 0
    given, bare = (bound.plan for bound, _ in launch_env.calls)
    assert (given.options["save_pid"], given.entry) == (str(pid), ("train.py", "--lr", "1"))
    assert bare.entry == ("odd.pid",)
    assert bare.options["save_pid"] not in (None, "", "odd.pid")


@pytest.mark.parametrize("flag", ["--dry-run", "--dry_run"])
def test_dry_run_takes_a_separate_json_or_text(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    plan = _json(capsys, ["--launcher", "fake", flag, "json", "s.py", "text"])
    assert plan["commands"][0][-2:] == ["s.py", "text"]
    assert main(["--launcher", "fake", flag, "text", "s.py"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  entry:     s\.py$", out, re.M)
    assert main(["--launcher", "fake", flag, "json.py"]) == 0  # not one of the two words: the script
    assert re.search(r"^  entry:     json\.py$", capsys.readouterr().out, re.M)
    assert launch_env.calls == []


# --- a multi-node rendezvous never sits on a loopback address -------------------------------------------------

LOOPBACK_CASES = [
    ("localhost slots=1\nw1 slots=1\n", [], "the first host 'localhost'", "2 nodes"),
    ("LOCALHOST slots=1\nw1 slots=1\n", [], "the first host 'LOCALHOST'", "2 nodes"),
    ("127.0.1.1 slots=1\nw1 slots=1\n", [], "the first host '127.0.1.1'", "2 nodes"),
    ("ip6-localhost slots=1\nw1 slots=1\n", [], "the first host 'ip6-localhost'", "2 nodes"),
    ("w0 slots=1\nw1 slots=1\nw2 slots=1\n", ["--master-addr", "localhost"], "--master-addr localhost", "3 nodes"),
    ("w0 slots=1\nw1 slots=1\n", ["--master_addr", "127.0.0.1"], "--master-addr 127.0.0.1", "2 nodes"),
    ("w0 slots=1\nw1 slots=1\n", ["--master-addr", "[::1]"], "--master-addr ::1", "2 nodes"),
    ("localhost slots=2\n", ["--nnodes", "1:3"], "the first host 'localhost'", "up to 3 nodes (--nnodes 1:3)"),
    ("w0 slots=2\n", ["--nnodes", "1:2", "--master-addr", "localhost"], "--master-addr localhost", "up to 2 nodes"),
]


@pytest.mark.parametrize(("hostfile", "flags", "where", "what"), LOOPBACK_CASES)
def test_multi_node_rendezvous_on_loopback_is_an_error(
    launch_env: Executions,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    hostfile: str,
    flags: list[str],
    where: str,
    what: str,
) -> None:
    hf = _hostfile(tmp_path / "hf", hostfile)
    msg = _error(capsys, ["-H", hf, *flags, "--launcher", "fake", "t.py"], launch_env)
    fix = (
        "pass --master-addr with the first host's routable name or address"
        if where.startswith("--master-addr")
        else "list the first host by a name or address the other nodes can reach, or pass --master-addr ADDR"
    )
    assert msg.startswith(f"rendezvous on {where} is a loopback address but the job spans {what}")
    assert msg.endswith(f": every node would host its own rendezvous (split brain); {fix}")


def test_single_node_and_routable_master_keep_their_rendezvous(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    one = _hostfile(tmp_path / "one", "localhost slots=2\n")
    plan = _json(capsys, ["-H", one, "--nnodes", "1:3", "--launcher", "local", "--dry-run=json", "t.py"])
    assert plan["master_addr"] == "127.0.0.1"  # the local backend never starts another node
    plan = _json(capsys, ["-H", one, "--master-addr", "localhost", "--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["master_addr"] == "localhost"
    two = _hostfile(tmp_path / "two", "localhost slots=1\nw1 slots=1\n")
    plan = _json(capsys, ["-H", two, "--master-addr", "10.0.0.9", "--launcher", "fake", "--dry-run=json", "t.py"])
    assert plan["master_addr"] == "10.0.0.9"


# --- the default pid file is private ---------------------------------------------------------------------------


def test_default_pid_file_in_xdg_runtime_dir(
    launch_env: Executions, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert main(["--launcher", "fake", "--save-pid", "t.py"]) == 0
    [(bound, _)] = launch_env.calls
    assert bound.plan.options["save_pid"] == str(runtime / f"elasticzero-{os.getpid()}.pid")


@pytest.mark.parametrize("xdg", [None, "relative/run", "/nonexistent-ez-runtime"])
def test_default_pid_file_without_runtime_dir_is_in_a_fresh_private_dir(
    launch_env: Executions, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    if xdg is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    seen: list[tuple[str, int]] = []

    def execute(bound: Any, backend: Any, **_: Any) -> int:
        path = Path(bound.plan.options["save_pid"])
        seen.append((str(path.relative_to(temp)), stat.S_IMODE(path.parent.stat().st_mode)))
        return 0

    monkeypatch.setattr(sys.modules["elasticzero.launch.execute"], "execute", execute)  # the fixture's stub
    assert main(["--launcher", "fake", "--save-pid", "t.py"]) == 0
    [(rel, mode)] = seen
    assert re.fullmatch(r"elasticzero-[^/]+/launcher\.pid", rel)
    assert mode == 0o700
    assert list(temp.iterdir()) == []  # the private directory is removed at exit


def test_dry_run_with_save_pid_leaves_no_directory(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert _json(capsys, ["--launcher", "fake", "--save-pid", "--dry-run=json", "t.py"])["backend"] == "fake"
    assert _error(capsys, ["--launcher", "bogus", "--save-pid", "t.py"], launch_env).startswith("unknown --launcher")
    # a launch stopped by its checks (missing program, preflight) never made the default pid directory either
    assert "needs 'ez-no-such-program-anywhere'" in _error(
        capsys, ["--launcher", "fake-missing", "--save-pid", "t"], launch_env
    )
    assert list(temp.iterdir()) == []


# --- host names in filters match like hostfile hosts ----------------------------------------------------------


def test_filters_match_host_names_case_insensitively(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hf = _hostfile(tmp_path / "hf", "Worker-0 slots=2\nworker-1 slots=2\nNode-2 slots=1\n")
    plan = _json(capsys, ["-H", hf, "-i", "worker-0@node-2", "--launcher", "fake", "--dry-run=json", "t.py"])
    assert [(n["host"], n["slots"]) for n in plan["nodes"]] == [("Worker-0", [0, 1]), ("Node-2", [0])]
    plan = _json(capsys, ["-H", hf, "-e", "WORKER-1@worker-0:0", "--launcher", "fake", "--dry-run=json", "t.py"])
    assert [(n["host"], n["slots"]) for n in plan["nodes"]] == [("Worker-0", [1]), ("Node-2", [0])]
    assert plan["master_addr"] == "Worker-0"


def test_ipv6_hostfile_host_is_refused_before_any_backend(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hf = _hostfile(tmp_path / "hf", "::1 slots=2\n")
    for launcher in ("local", "pdsh", "fake"):
        msg = _error(capsys, ["-H", hf, "--launcher", launcher, "t.py"], launch_env)
        assert msg.startswith(f"{hf}:1: IPv6 address '::1' cannot be a host") and "/etc/hosts" in msg


def test_unbalanced_launcher_args_quote_is_a_usage_error(
    launch_env: Executions, capsys: pytest.CaptureFixture[str]
) -> None:
    msg = _error(capsys, ["--launcher", "fake", "--launcher-args", "--mca 'a", "t.py"], launch_env)
    assert msg == '--launcher-args "--mca \'a": No closing quotation; balance the quotes'


# --- typed backend options ----------------------------------------------------------------------------------------


def test_launcher_opt_sets_typed_options_shown_by_dry_run(
    launch_env: Executions, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--launcher", "fake", "--launcher-opt", "site_queue=gpu", "--launcher_opt", "site_timeout=2.5"]
    plan = _json(capsys, [*argv, "--ssh-port", "2200", "--dry-run=json", "t.py"])
    assert plan["options"] == {
        "max_node_restarts": 0, "save_pid": None, "site_queue": "gpu", "site_timeout": 2.5, "ssh_check": True,
        "ssh_port": 2200,
    }  # fmt: skip
    assert main([*argv, "--dry-run", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "options:   max_node_restarts=0 save_pid=None site_queue='gpu' site_timeout=2.5 ssh_check=True" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launcher-opt", "nope=1"], "launcher 'fake' has no option 'nope' (set by --launcher-opt nope=…); "
         "valid options: max_node_restarts, save_pid, site_queue, site_timeout, ssh_check, ssh_port; "
         "see elasticzero-launch --help"),
        (["--launcher-opt", "site_timeout=soon"], "launcher 'fake': option site_timeout='soon': expected float"),
        (["--launcher-opt", "site_queue=cpu"], "option site_queue='cpu': expected one of default, gpu"),
        (["--launcher-opt", "ssh_check=maybe"], "launcher 'fake': option ssh_check='maybe': expected true or false"),
        (["--launcher-opt", "site_queue"], "--launcher-opt 'site_queue': expected KEY=VALUE"),
        (["--ssh-port", "22", "--launcher-opt", "ssh_port=23"], "option 'ssh_port' is already set by --ssh-port"),
        (["--per-rank"], "launcher 'fake' has no option 'per_rank' (set by --per-rank)"),
    ],
)  # fmt: skip
def test_unknown_or_mistyped_options_are_one_clear_error(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in _error(capsys, ["--launcher", "fake", *argv, "t.py"], launch_env)


def test_mpiexec_and_mvapich_launcher_are_settable(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hf = _hostfile(tmp_path / "hf")
    odd = "/opt/my mpi/bin/mpiexec;$(x)"  # a hostile value stays one argv element
    plan = _json(capsys, ["-H", hf, "--launcher", "mpich", "--launcher-opt", f"mpiexec={odd}", "--dry-run=json", "t"])
    assert plan["commands"][0][0] == odd and plan["options"]["mpiexec"] == odd
    argv = ["-H", hf, "--launcher", "mvapich", "--launcher-opt", "mvapich_launcher=hydra", "--dry-run=json", "t"]
    plan = _json(capsys, argv)
    assert plan["commands"][0][0] == "mpiexec" and "-genvlist" in plan["commands"][0]
    assert plan["options"] == {
        "max_node_restarts": 0, "mpiexec": "mpiexec", "mvapich_launcher": "hydra", "per_rank": False, "save_pid": None
    }  # fmt: skip
    argv = ["-H", hf, "--launcher", "mvapich", "--launcher-opt", "mvapich_launcher=rsh", "t"]
    assert "expected one of mpirun_rsh, hydra" in _error(capsys, argv, launch_env)


def test_help_lists_every_backends_options(launch_env: Executions, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--launcher-opt KEY=VALUE" in out
    section = out[out.index("launcher options") :]
    parts = re.split(r"^  (\S[^:]*):$", section, flags=re.MULTILINE)
    blocks = dict(zip(parts[1::2], parts[2::2], strict=True))
    for backend, option in [
        ("pdsh", "ssh_port (int, default None; flag --ssh-port)"),
        ("mpich", "mpiexec (str, default 'mpiexec.hydra')"),
        ("mvapich", "mvapich_launcher (mpirun_rsh|hydra, default 'mpirun_rsh')"),
        ("no-ssh", "node_rank (int, default None; flag --node-rank)"),
        ("fake", "site_queue (default|gpu, default 'default')"),  # a site's own plugin
        ("slurm", "per_rank (bool, default False; flag --per-rank)"),
    ]:
        assert option in blocks[backend], (backend, option)
    assert "save_pid (str, default None; flag --save-pid)" in blocks["every launcher"]


# --- planning is pure ---------------------------------------------------------------------------------------------

PURE_BACKENDS = {  # backend → the flags that select it and its options
    "fake": ["--launcher", "fake", "--no-ssh-check", "--launcher-opt", "site_queue=gpu"],
    "pdsh": ["--launcher", "pdsh", "--ssh-port", "2222", "--no-ssh-check"],
    "openmpi": ["--launcher", "openmpi", "--per-rank"],
    "mpich": ["--launcher", "mpich", "--launcher-opt", "mpiexec=mpiexec"],
    "mvapich": ["--launcher", "mvapich"],
    "slurm": ["--launcher", "slurm", "--per-rank"],
    "local": ["--launcher", "local", "--num-nodes", "1"],
    "no-ssh": ["--no-ssh", "--node-rank", "1"],
}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its mode and modification time."""
    return {str(p): (p.lstat().st_mode, p.lstat().st_mtime_ns) for p in [root, *root.rglob("*")]}


def test_dry_run_touches_nothing_with_any_flag_combination(
    launch_env: Executions, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import itertools

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "1")  # srun's CPU count from the (absent) allocation: no sinfo call
    secret = "hf_s3cr3t 'q' %h\nline"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("EZ_A", "$(touch /tmp/ez-pwn)")
    (Path(os.environ["HOME"]) / ".elasticzero_env").write_text("WANDB_API_KEY='wandb-s3cr3t'\n")
    hf = _hostfile(tmp_path / "hf", "w0 slots=2\nw1 slots=2\n")
    optional = [  # the flags that name something on disk, plus exported values
        ["--save-pid"], [f"--save-pid={tmp_path / 'job-pid'}"], ["--log-dir", "logs"],
        ["--export", "EZ_A", "--export-prefix", "EZ_", "--bind-cores-to-rank", "--max-restarts", "2"],
    ]  # fmt: skip
    before = _tree(tmp_path)
    runs = 0
    for name, select in PURE_BACKENDS.items():
        for n in range(len(optional) + 1):
            for combo in itertools.combinations(optional, n):
                fmt = "--dry-run=json" if runs % 2 else "--dry-run"
                argv = ["-H", hf, *select, *itertools.chain.from_iterable(combo), fmt, "t.py", "--x"]
                assert main(argv) == 0, (name, argv, capsys.readouterr().err)
                out = capsys.readouterr()
                for value in (secret, "hf_s3cr3t", "wandb-s3cr3t"):
                    assert value not in out.out + out.err, (name, argv)
                runs += 1
    assert runs == len(PURE_BACKENDS) * 2 ** len(optional)
    assert _tree(tmp_path) == before  # no file, directory, pid file or log dir was created or changed
    assert launch_env.calls == []


@pytest.mark.parametrize("name", sorted(PURE_BACKENDS))
def test_dry_run_prints_the_very_commands_execute_runs(
    name: str,
    launch_env: Executions,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """One bind per launch; the dry run prints what it returned, the launch executes what it returned."""
    import shutil

    from elasticzero.launch.backend import LauncherBackend

    bound_plans: list[Any] = []
    bind = LauncherBackend.bind

    def spy(self: LauncherBackend, plan: Any, sources: Any = None) -> Any:
        bound_plans.append(bind(self, plan, sources))
        return bound_plans[-1]

    monkeypatch.setattr(LauncherBackend, "bind", spy)
    monkeypatch.setattr(shutil, "which", lambda prog: f"/usr/bin/{prog}")  # every transport "installed"
    monkeypatch.setenv("SLURM_JOB_ID", "1")  # srun's CPU count from the (absent) allocation: no sinfo call
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    hf = _hostfile(tmp_path / "hf", "w0 slots=2\nw1 slots=2\n")
    argv = ["-H", hf, *PURE_BACKENDS[name], "--rdzv-id", "ez-same-1"]
    shown = _json(capsys, [*argv, "--dry-run=json", "t.py", "--x"])
    assert main([*argv, "--dry-run", "t.py", "--x"]) == 0
    text = capsys.readouterr().out
    assert main([*argv, "t.py", "--x"]) == 0
    printed, printed_text, executed = bound_plans  # bound once per launch, dry run or not
    [(ran, _)] = launch_env.calls
    assert ran.commands is executed.commands  # execute got the commands bind built, not a rebuild
    assert shown["commands"] == [list(c.argv) for c in printed.commands]
    assert all(shlex.join(c.argv) in text for c in printed_text.commands)
    assert "hf_s3cr3t" not in json.dumps(shown) + text

    # launches apart differ only by the plan's nonce (pdsh's env directory): the same argv, byte for byte
    def plain(argv: Any) -> list[str]:
        return [a.replace(printed.plan.nonce, "N").replace(executed.plan.nonce, "N") for a in argv]

    assert [plain(c) for c in shown["commands"]] == [plain(c.argv) for c in ran.commands]
    assert [c.env for c in ran.commands] == [c.env for c in printed.commands]  # the real values, unmasked


def test_deepspeed_ssh_flags_are_ignored_with_a_note_where_no_ssh_is_used(
    launch_env: Executions, capsys: pytest.CaptureFixture[str]
) -> None:
    """``deepspeed --ssh_port 2222 --no_ssh_check`` on one node runs; so does ours (local has no ssh options)."""
    assert main(["--ssh_port", "2222", "--no_ssh_check", "--dry-run=json", "t.py"]) == 0
    captured = capsys.readouterr()
    plan, err = json.loads(captured.out), captured.err
    assert plan["backend"] == "local" and "ssh_port" not in plan["options"]
    assert "--ssh-port does not apply to launcher 'local' (no ssh); ignored" in err
    assert launch_env.calls == []
