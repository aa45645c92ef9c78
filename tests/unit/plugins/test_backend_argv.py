"""The argv and env each shipped backend builds (pure: nothing is started)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from plugin_plans import HOSTILE, PY, make_plan

import elasticzero_plugins.slurm as slurm_plugin
from elasticzero.errors import UsageError
from elasticzero.launch.backend import available_launchers, get_launcher
from elasticzero_plugins._common import rankenv_argv as rankenv_prog
from elasticzero_plugins.mpich import HYDRA_ENV_PAD

TABLE = '[["node1",[0,1]],["node2",[2,3]]]'
JOB = "ELASTICZERO_JOB_ID"


def agent(identity: list[str], nnodes: str = "2", table: str = TABLE) -> list[str]:
    head = [PY, "-u", "-X", "frozen_modules=off", "-m", "elasticzero.agent.cli"]
    head += ["--nnodes", nnodes, "--node-table", table, *identity]
    tail = ["--rdzv-backend", "elasticzero", "--rdzv-endpoint", "node1:29500", "--rdzv-id", "ez-test-1"]
    return [*head, *tail, "--max-restarts", "0", "train.py", "--lr", "0.1"]


def rankenv(host_env: str | None = None) -> list[str]:
    argv = [PY, "-u", "-m", "elasticzero.launch.rankenv", "--node-table", TABLE]
    argv += ["--node-host-env", host_env] if host_env else []
    return [*argv, "--master-addr", "node1", "--master-port", "29500", "--", "train.py", "--lr", "0.1"]


def test_every_backend_is_registered() -> None:
    names = set(available_launchers())
    assert {"pdsh", "openmpi", "mpich", "mvapich", "slurm", "local", "no-ssh"} <= names
    for name in names:
        assert get_launcher(name).name == name


def test_openmpi_agent_argv_env_by_name() -> None:
    (cmd,) = get_launcher("openmpi").bind(make_plan("openmpi")).commands
    assert list(cmd.argv) == [
        "mpirun.openmpi", "--allow-run-as-root", "--bind-to", "none", "-wdir", "/work/dir",
        "-H", "node1,node2", "-npernode", "1", "-np", "2", "-x", "NCCL_DEBUG", "-x", JOB,
        *agent(["--node-rank-env", "OMPI_COMM_WORLD_RANK"]),
    ]  # fmt: skip
    assert cmd.env == {"NCCL_DEBUG": "INFO", JOB: "ez-test-1"}


def test_openmpi_per_rank() -> None:
    (cmd,) = get_launcher("openmpi").bind(make_plan("openmpi", options={"per_rank": True})).commands
    argv = list(cmd.argv)
    assert argv[argv.index("-H") + 1] == "node1:2,node2:2"
    assert argv[argv.index("-np") + 1] == "4" and "--map-by" in argv
    assert argv[-len(rankenv()) :] == rankenv()


def test_mpich_agent_argv_and_env_pad() -> None:
    (cmd,) = get_launcher("mpich").bind(make_plan("mpich", launcher_args=("-localhost", "10.0.0.1"))).commands
    assert list(cmd.argv) == [
        "mpiexec.hydra", "-hosts", "node1,node2", "-ppn", "1", "-n", "2", "-wdir", "/work/dir",
        "-genvlist", f"NCCL_DEBUG,{JOB}", "-localhost", "10.0.0.1", *agent(["--node-rank-env", "PMI_RANK"]),
    ]  # fmt: skip
    # hydra 4.0.2 drops the last variable of its environment: a pad that is not forwarded comes last
    assert list(cmd.env)[-1] == HYDRA_ENV_PAD and HYDRA_ENV_PAD not in cmd.argv[cmd.argv.index("-genvlist") + 1]


def test_mpich_per_rank() -> None:
    (cmd,) = get_launcher("mpich").bind(make_plan("mpich", options={"per_rank": True})).commands
    argv = list(cmd.argv)
    assert argv[:5] == ["mpiexec.hydra", "-hosts", "node1:2,node2:2", "-n", "4"]
    assert argv[-len(rankenv()) :] == rankenv()


SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_CPUS_PER_NODE", "SLURM_CPUS_ON_NODE")
REAL_SINFO_CPUS = slurm_plugin.sinfo_cpus  # the autouse fixture below stubs the module attribute


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts outside an allocation, with sinfo unable to tell the CPU count (no real sinfo call)."""
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(slurm_plugin, "sinfo_cpus", lambda hosts: None)


def test_slurm_agent_argv_env_in_srun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_plugin, "sinfo_cpus", lambda hosts: 8 if list(hosts) == ["node1", "node2"] else None)
    plan = make_plan("slurm", env={"V": "a,b 'c' \"d\""})
    (cmd,) = get_launcher("slurm").bind(plan).commands
    assert list(cmd.argv) == [
        "srun", "--nodelist=node1,node2", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--cpu-bind=none",
        "--exclusive", "--cpus-per-task=8", "--export=ALL", "--chdir=/work/dir",
        *agent(["--node-host-env", "SLURMD_NODENAME"]),
    ]  # fmt: skip
    assert cmd.env == {"V": "a,b 'c' \"d\"", JOB: "ez-test-1"}


IN_JOB = {"SLURM_JOB_ID": "42"}


@pytest.mark.parametrize(
    ("env", "sinfo", "cpu_args"),
    [
        ({}, 16, ["--cpu-bind=none", "--exclusive", "--cpus-per-task=16"]),  # srun allocates whole nodes
        ({}, None, ["--cpu-bind=none", "--exclusive"]),  # sinfo could not tell
        ({**IN_JOB, "SLURM_CPUS_ON_NODE": "48"}, 99, ["--cpu-bind=none", "--cpus-per-task=48"]),
        ({**IN_JOB, "SLURM_JOB_CPUS_PER_NODE": "64(x2),32", "SLURM_CPUS_ON_NODE": "64"}, 99,
         ["--cpu-bind=none", "--cpus-per-task=32"]),
        ({**IN_JOB, "SLURM_JOB_CPUS_PER_NODE": "garbled", "SLURM_CPUS_ON_NODE": "8"}, 99,
         ["--cpu-bind=none", "--cpus-per-task=8"]),
        ({**IN_JOB, "SLURM_CPUS_ON_NODE": "0"}, 99, ["--cpu-bind=none"]),  # unknown: Slurm's default
    ],
)  # fmt: skip
def test_slurm_agent_task_gets_every_cpu_of_its_node(
    env: dict[str, str], sinfo: int | None, cpu_args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(slurm_plugin, "sinfo_cpus", lambda hosts: sinfo)
    (cmd,) = get_launcher("slurm").bind(make_plan("slurm", launcher_args=("--cpus-per-task=4",))).commands
    argv = list(cmd.argv)
    i = argv.index("--ntasks=2")
    assert argv[i + 1 : argv.index("--export=ALL")] == cpu_args
    assert argv.index("--cpus-per-task=4") > argv.index("--export=ALL")  # --launcher-args come later: they win
    (rr,) = get_launcher("slurm").bind(make_plan("slurm", options={"per_rank": True})).commands
    assert not {"--cpu-bind=none", "--exclusive"} & set(rr.argv)  # per-rank: Slurm's own placement per rank


@pytest.mark.parametrize(("out", "rc", "expect"), [("8\n4\n", 0, 4), ("", 0, None), ("8\n", 1, None), ("n/a", 0, None)])
def test_sinfo_cpus_reads_the_smallest_node(
    out: str, rc: int, expect: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = tmp_path / "args"
    sinfo = tmp_path / "sinfo"
    script = f'printf "%s\\n" "$@" > {shlex.quote(str(args))}\nprintf {shlex.quote(out)}\nexit {rc}\n'
    sinfo.write_text("#!/bin/sh\n" + script)
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert REAL_SINFO_CPUS(["n1", "n2"]) == expect
    assert args.read_text().split("\n")[:4] == ["--noheader", "--Node", "--nodes=n1,n2", "--format=%c"]


def test_slurm_per_rank_needs_even_slots() -> None:
    (cmd,) = get_launcher("slurm").bind(make_plan("slurm", options={"per_rank": True})).commands
    assert "--ntasks-per-node=2" in cmd.argv and "--ntasks=4" in cmd.argv
    assert list(cmd.argv[-len(rankenv("SLURMD_NODENAME")) :]) == rankenv("SLURMD_NODENAME")
    uneven = make_plan("slurm", [("node1", [0, 1]), ("node2", [0])], options={"per_rank": True})
    with pytest.raises(UsageError, match="same number of slots"):
        get_launcher("slurm").bind(uneven)


def test_mvapich_mpirun_rsh_shape() -> None:
    (cmd,) = get_launcher("mvapich").bind(make_plan("mvapich")).commands
    prog = [shlex.quote(a) for a in agent(["--node-rank-env", "MV2_COMM_WORLD_RANK"])]
    assert list(cmd.argv) == ["mpirun_rsh", "-export", "-np", "2", "node1", "node2", *prog]
    assert f"'{TABLE}'" in cmd.argv  # the node table keeps its JSON quotes through mpirun_rsh's shell
    assert cmd.env == {"NCCL_DEBUG": "INFO", JOB: "ez-test-1"}
    (rr,) = get_launcher("mvapich").bind(make_plan("mvapich", options={"per_rank": True})).commands
    assert list(rr.argv[:8]) == ["mpirun_rsh", "-export", "-np", "4", "node1", "node1", "node2", "node2"]


def test_mvapich_hydra_flavour() -> None:
    plan = make_plan("mvapich", options={"mvapich_launcher": "hydra"})
    (cmd,) = get_launcher("mvapich").bind(plan).commands
    assert cmd.argv[0] == "mpiexec" and "-genvlist" in cmd.argv and "PMI_RANK" in cmd.argv
    with pytest.raises(UsageError, match="mvapich_launcher"):
        get_launcher("mvapich").bind(make_plan("mvapich", options={"mvapich_launcher": "rsh"}))


def test_local_and_no_ssh() -> None:
    (cmd,) = get_launcher("local").bind(make_plan("local", [("localhost", [0, 1])])).commands
    argv = list(cmd.argv)
    assert argv[:12] == [PY, "-u", "-X", "frozen_modules=off", "-m", "elasticzero.agent.cli", "--nnodes", "1",
                         "--node-table", '[["localhost",[0,1]]]', "--node-rank", "0"]  # fmt: skip
    assert cmd.env == {"NCCL_DEBUG": "INFO", JOB: "ez-test-1"} and cmd.host == "localhost"
    with pytest.raises(UsageError, match="one node"):
        get_launcher("local").bind(make_plan("local"))
    (mine,) = get_launcher("no-ssh").bind(make_plan("no-ssh", options={"node_rank": 1})).commands
    assert mine.host == "node2" and list(mine.argv) == agent(["--node-rank", "1"])
    for bad, message in ((None, "needs --node-rank"), (2, "--node-rank 2 is out of range"), ("x", "node_rank='x'")):
        with pytest.raises(UsageError, match=message):
            get_launcher("no-ssh").bind(make_plan("no-ssh", options={"node_rank": bad}))


def own_options(name: str) -> dict[str, Any]:
    """The options a plan for backend ``name`` needs (no-ssh: which node this is)."""
    return {"node_rank": 0} if name == "no-ssh" else {}


@pytest.mark.parametrize("name", ["pdsh", "local", "no-ssh"])
def test_per_rank_rejected_where_an_agent_is_required(name: str) -> None:
    nodes = [("localhost", [0])] if name == "local" else None
    with pytest.raises(UsageError, match=f"launcher '{name}' has no option 'per_rank'"):
        get_launcher(name).bind(make_plan(name, nodes, options={"per_rank": True, **own_options(name)}))


@pytest.mark.parametrize("name", ["openmpi", "mpich", "mvapich", "slurm"])
def test_values_never_on_the_argv(name: str) -> None:
    env = {f"V{i}": v for i, v in enumerate(HOSTILE) if v}
    (cmd,) = get_launcher(name).bind(make_plan(name, env=env)).commands
    for value in env.values():
        assert all(value not in a for a in cmd.argv), value
        assert value in cmd.env.values()


@pytest.mark.parametrize("name", ["openmpi", "mpich", "mvapich", "slurm", "local", "no-ssh"])
def test_bound_commands_carry_the_real_secret_values_by_name(name: str) -> None:
    """bind hands ``commands()`` stand-ins for secret values and puts the real ones back into ``Command.env``."""
    env = {"HF_TOKEN": HOSTILE[0], "DB_KEY": "1", "NCCL_DEBUG": "INFO"}
    nodes = [("localhost", [0])] if name == "local" else None
    bound = get_launcher(name).bind(make_plan(name, nodes, env=env, options=own_options(name)))
    assert bound.plan.env == env
    for cmd in bound.commands:
        assert {k: cmd.env[k] for k in env} == env
        assert "ezsecret" not in repr(cmd)  # no stand-in survives anywhere


def _one_shell_parse(words: list[str]) -> list[str]:
    """``words`` joined by spaces and parsed by one real ``sh -c`` (what mpirun_rsh's ssh does)."""
    script = "printf '%s\\0' " + " ".join(words)
    p = subprocess.run(["sh", "-c", script], capture_output=True, timeout=30, check=True)
    assert p.stdout.endswith(b"\0"), p.stdout
    return p.stdout[:-1].decode().split("\0")


@pytest.mark.parametrize("per_rank", [False, True])
def test_mvapich_mpirun_rsh_argv_survives_one_shell(per_rank: bool, tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    mark.mkdir()
    hostile = [*HOSTILE, f"a;touch {mark}/semi", f"$(touch {mark}/dollar)", f"`touch {mark}/tick`", "x'y\"z"]
    plan = make_plan("mvapich", entry=("t.py", *hostile), options={"per_rank": per_rank})
    (cmd,) = get_launcher("mvapich").bind(plan).commands
    expected = rankenv_prog(plan) if per_rank else plan.agent_argv(["--node-rank-env", "MV2_COMM_WORLD_RANK"])
    built = list(cmd.argv[cmd.argv.index("node2") + (2 if per_rank else 1) :])
    assert len(built) == len(expected)
    assert _one_shell_parse(built) == expected  # byte-exact after the remote shell
    assert list(mark.iterdir()) == []  # nothing ran


def test_mvapich_hydra_argv_stays_verbatim() -> None:
    plan = make_plan("mvapich", entry=("t.py", *HOSTILE), options={"mvapich_launcher": "hydra"})
    (cmd,) = get_launcher("mvapich").bind(plan).commands
    assert list(cmd.argv[-len(HOSTILE) :]) == HOSTILE


def test_mvapich_mpirun_rsh_rejects_a_cwd_needing_quotes() -> None:
    with pytest.raises(UsageError, match="working directory"):
        get_launcher("mvapich").bind(make_plan("mvapich", cwd="/w/$(x) 'a' ;b"))
    get_launcher("mvapich").bind(make_plan("mvapich", options={"mvapich_launcher": "hydra"}, cwd="/w/a b"))


@pytest.mark.parametrize("name", ["openmpi", "mpich", "slurm", "local", "no-ssh"])
def test_hostile_entry_and_cwd_are_single_argv_elements(name: str) -> None:
    nodes = [("localhost", [0])] if name == "local" else None
    plan = make_plan(name, nodes, entry=("t.py", *HOSTILE), cwd="/w/$(x) 'a' ;b", options=own_options(name))
    (cmd,) = get_launcher(name).bind(plan).commands
    assert list(cmd.argv[-len(HOSTILE) :]) == HOSTILE


def test_launcher_args_are_inserted_raw() -> None:
    raw = ("--mca", "btl", "tcp,self")
    (cmd,) = get_launcher("openmpi").bind(make_plan("openmpi", launcher_args=raw)).commands
    i = list(cmd.argv).index("--mca")
    assert cmd.argv[i : i + 3] == raw and cmd.argv[i + 3] == PY


BAD_HOSTS = ["a;b", "n1,n2", "-oProxyCommand=x", "node[1-2]", "user@h", "::1", "", "a b", "n\n", "$(x)", "h%n"]


@pytest.mark.parametrize("name", ["pdsh", "openmpi", "mpich", "mvapich", "slurm", "no-ssh"])
@pytest.mark.parametrize("host", BAD_HOSTS)
def test_hostile_host_names_rejected(name: str, host: str) -> None:
    plan = make_plan(name, [("node1", [0]), (host, [0])], options=own_options(name))
    with pytest.raises(UsageError, match="host name"):
        get_launcher(name).bind(plan)


@pytest.mark.parametrize("name", ["pdsh", "openmpi", "slurm"])
def test_invalid_env_names_rejected(name: str) -> None:
    with pytest.raises(UsageError, match="environment variable name"):
        get_launcher(name).bind(make_plan(name, env={"A;B": "1"}))
