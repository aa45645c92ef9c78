"""Per-rank mode: scheduler variables → torch's, hostfile order, slots, and the child's exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.rankenv import resolve, torch_env

TABLE = [("nodeB", [0, 1]), ("nodeA", [4, 5])]


@pytest.mark.parametrize(
    "env",
    [
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
        {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"},
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"},
    ],
    ids=["openmpi", "mvapich", "pmi", "slurm"],
)
def test_families_block_layout(env: dict[str, str]) -> None:
    info = resolve(env, TABLE)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node) == (3, 4, 1, 2, 1)
    assert torch_env(info, "nodeB", 29500) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "4,5",
        "MASTER_ADDR": "nodeB", "MASTER_PORT": "29500",
    }  # fmt: skip


def test_without_table_the_transport_values_are_used() -> None:
    info = resolve({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})  # fmt: skip
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.slots) == (2, 3, 0, 1, None)
    assert "CUDA_VISIBLE_DEVICES" not in torch_env(info, None, None)


def test_slurm_order_is_remapped_to_hostfile_order() -> None:
    # Slurm sorts nodes by name: nodeA got procids 0,1 but is second in the hostfile
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "nodeA"}
    info = resolve(env, TABLE, "SLURMD_NODENAME")
    assert (info.rank, info.node, info.slots) == (3, 1, (4, 5))
    short = resolve({**env, "SLURMD_NODENAME": "nodeB.cluster"}, TABLE, "SLURMD_NODENAME")
    assert short.rank == 1


@pytest.mark.parametrize(
    ("env", "host_env", "match"),
    [
        ({}, None, "no scheduler rank variable"),
        ({"PMI_RANK": "x", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}, None, "not an integer"),
        ({"PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"}, None, "4 slots but the scheduler started 3"),
        ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, None, "hostfile-order blocks"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "H": "other"}, "H", "not a host"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "2", "H": "nodeA"}, "H", "has 2 slots"),
    ],
)
def test_errors(env: dict[str, str], host_env: str | None, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        resolve(env, TABLE, host_env)


def _rankenv(extra_env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MV2_"))}
    return subprocess.run(
        [sys.executable, "-m", "elasticzero.launch.rankenv", *argv],
        env={**env, **extra_env}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_main_runs_the_script_with_torch_env_and_exact_args() -> None:
    prog = "import json,os,sys; print(json.dumps([os.environ['RANK'], os.environ['MASTER_PORT'], sys.argv[1:]]))"
    args = ["a;b", "$(x)", "", "new\nline"]
    p = _rankenv(
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"},
        "--node-table", '[["h",[0,1]]]', "--master-addr", "h", "--master-port", "1234", "--no-python", "--",
        sys.executable, "-c", prog, *args,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["1", "1234", args]


def test_main_reports_signal_death_as_128_plus_signal_and_usage_errors_as_2() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    p = _rankenv(env, "--no-python", "--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)")
    assert p.returncode == 128 + signal.SIGKILL
    assert _rankenv(env, "--no-python", "--", sys.executable, "-c", "raise SystemExit(5)").returncode == 5
    bad = _rankenv({}, "--", "x.py")
    assert bad.returncode == 2 and "no scheduler rank variable" in bad.stderr


SIGNAL_DURING_START = """
import os, signal, subprocess, sys
from elasticzero.launch import rankenv
real = subprocess.Popen
def popen(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the child is being started
    return real(*a, **k)
rankenv.subprocess.Popen = popen
rc = rankenv.run_child([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
print("rc", rc)
"""


def test_a_signal_during_start_is_forwarded_not_fatal() -> None:
    p = subprocess.run([sys.executable, "-c", SIGNAL_DURING_START], capture_output=True, text=True, timeout=50)
    assert (p.returncode, p.stdout) == (0, f"rc {128 + signal.SIGTERM}\n"), p.stderr
