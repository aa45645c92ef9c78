"""Fixtures for the launch front-end tests: a clean environment and a test backend registered as a real plugin.

The test backend is installed the way a site would add one: a ``*.dist-info`` with an ``elasticzero.launchers``
entry point, put on ``sys.path``, so ``--launcher fake`` goes through the real registry.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from elasticzero.launch import resources

FAKE_BACKEND = """
from elasticzero.launch.backend import BackendOption, Command, LauncherBackend

CALLS = []


class FakeBackend(LauncherBackend):
    # a site's backend declares its options like the shipped ones
    name = "fake"
    options = (
        BackendOption("ssh_port", int, None, "port", flag="--ssh-port"),
        BackendOption("ssh_check", bool, True, "check ssh", flag="--no-ssh-check"),
        BackendOption("site_queue", str, "default", "the site's queue", choices=("default", "gpu")),
        BackendOption("site_timeout", float, 30.0, "seconds"),
    )

    def preflight(self, bound):
        CALLS.append(("preflight", bound))

    def commands(self, plan):
        CALLS.append(("commands", plan.job_id))
        return [
            Command(tuple(plan.agent_argv(["--node-rank", str(n.node_rank)])), host=n.host, env={"EZ_T_TOKEN": "x"})
            for n in plan.nodes
        ]


class InlineEnvBackend(FakeBackend):
    # carries env values inside argv (as pdsh's remote command string once did): bind refuses a secret one
    name = "fake-inline"

    def commands(self, plan):
        pairs = [f"{k}={v}" for k, v in plan.env.items()]
        return [Command(("env", *pairs, *plan.agent_argv(["--node-rank", "0"])))]


class MissingProgramBackend(FakeBackend):
    name = "fake-missing"
    required_programs = ("ez-no-such-program-anywhere",)
"""

ENTRY_POINTS = """[elasticzero.launchers]
fake = ez_fake_backend:FakeBackend
fake-missing = ez_fake_backend:MissingProgramBackend
fake-inline = ez_fake_backend:InlineEnvBackend
"""


@pytest.fixture(scope="session")
def fake_backend_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake_backend")
    (d / "ez_fake_backend.py").write_text(FAKE_BACKEND)
    info = d / "ez_fake_backend-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ez-fake-backend\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return d


@dataclass
class Executions:
    """What the stubbed ``elasticzero.launch.execute.execute`` was called with: (bound plan, backend) per call."""

    calls: list[tuple[Any, Any]] = field(default_factory=list)
    rc: int = 0


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_backend_dir: Path) -> Executions:
    """A clean launcher environment: no Slurm/CUDA/hostfile variables, HOME and cwd in tmp, CPU only,
    the fake backend registered, and ``execute`` stubbed to record its calls (so nothing starts)."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "NCCL", "UCX", "MV2", "MLFLOW", "WANDB", "HF_", "TORCH_", "PYTHON")):
            monkeypatch.delenv(name)
    for name in ("CUDA_VISIBLE_DEVICES", "ELASTICZERO_HOSTFILE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setattr(resources, "DEFAULT_HOSTFILE", str(tmp_path / "no-default-hostfile"))
    monkeypatch.setattr(resources, "detect_gpu_count", lambda: 0)
    monkeypatch.syspath_prepend(str(fake_backend_dir))
    record = Executions()

    def execute(bound: Any, backend: Any, **_: Any) -> int:
        record.calls.append((bound, backend))
        return record.rc

    stub = types.ModuleType("elasticzero.launch.execute")
    stub.execute = execute  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "elasticzero.launch.execute", stub)
    import ez_fake_backend  # type: ignore[import-not-found]

    ez_fake_backend.CALLS.clear()
    return record
