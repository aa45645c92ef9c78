"""``elasticzero-launch --rdzv-endpoint etcd://…`` on a real etcd (auth on) through the ``local`` backend.

One launch: the agent rendezvouses on etcd as the user of ``--rdzv-conf user=``, with the password from the
launcher's environment only — it is in no process's argv, in no output, and the job's keys appear under the
prefix the user may write (and are gone after the job).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from launchkit import WORKER, argv_hits, job_pids, kill_job, reports, wait_for, worker_env_clean

from cluster.etcd_server import EtcdCluster, etcd  # noqa: F401  (the fixture)

LAUNCH = str(Path(sys.executable).parent / "elasticzero-launch")
PASSWORD = f"ez-pw-{secrets.token_hex(8)}"
pytestmark = [pytest.mark.multiproc, pytest.mark.etcd, pytest.mark.timeout(240)]


def _keys(cluster: EtcdCluster, job: str) -> list[str]:
    out = cluster.etcdctl("get", "--prefix", "--keys-only", f"/elasticzero/{job}/", user="root:rootpw")
    return [k for k in out.split() if k]


def test_local_launch_on_an_etcd_rendezvous_with_a_user(etcd: EtcdCluster, tmp_path: Path) -> None:  # noqa: F811
    etcd.enable_auth("rootpw", "ezjob", PASSWORD, "/elasticzero/")
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    job = f"ezt-etcd-{secrets.token_hex(4)}"
    env = {**worker_env_clean(), "EZ_TEST_OUT": str(out), "EZ_TEST_HOLD": str(release), "OMP_NUM_THREADS": "1"}
    env["ELASTICZERO_ETCD_PASSWORD"] = PASSWORD
    argv = [LAUNCH, "--launcher", "local", "--nproc-per-node", "1", "--rdzv-id", job]
    argv += ["--rdzv-endpoint", etcd.endpoint(), "--rdzv-conf", "user=ezjob,connect_timeout=20"]
    argv += ["--export", "EZ_TEST_OUT", "--export", "EZ_TEST_HOLD", WORKER]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "held-0").exists() or proc.poll() is not None, 180, "the worker, held")
        assert proc.poll() is None, proc.communicate()
        assert any(k.endswith("/state") for k in _keys(etcd, job))  # the round lives in etcd, as ezjob wrote it
        pids = set(job_pids(job))
        assert len(pids) >= 2  # the agent (the launcher, exec'd) and its worker
        assert argv_hits([PASSWORD.encode()], {int(p) for p in os.listdir("/proc") if p.isdigit()}) == []
        release.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            kill_job(job)
    assert proc.returncode == 0, stderr[-4000:]
    assert PASSWORD not in stdout + stderr
    assert [(r["dist_world"], r["job"]) for r in reports({"env": {"EZ_TEST_OUT": str(out)}})] == [(1, job)]
    assert _keys(etcd, job) == []  # the last agent to leave removed the run's keys
