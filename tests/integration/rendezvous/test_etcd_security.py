"""TLS (mutual, throw-away CA) and user/password auth against real etcd servers."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from cluster.etcd_server import EtcdCluster, make_tls, require_etcd
from elasticzero.errors import UsageError
from elasticzero.rendezvous.etcd_client import EtcdAccessError
from elasticzero.rendezvous.handler import create_rdzv_handler
from ez_testing import require_program

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]

PASSWORD_ENV = "EZ_TEST_ETCD_PASSWORD"


def _params(endpoint: str, run_id: str = "sec", **conf: object) -> RendezvousParameters:
    return RendezvousParameters("elasticzero", endpoint, run_id, 1, 1, local_addr="127.0.0.1", join_timeout=20, **conf)


def _rendezvous_once(params: RendezvousParameters) -> None:
    handler = create_rdzv_handler(params)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    info.store.set("probe", "ok")
    assert info.store.get("probe") == b"ok"
    assert handler.shutdown()


def test_mutual_tls(tmp_path: Path) -> None:
    require_program("openssl")
    tls = make_tls(tmp_path / "pki")
    cluster = EtcdCluster.start(tmp_path / "etcd", 1, require_etcd("3.4"), tls=tls)
    try:
        conf = {"cacert": tls.ca, "cert": tls.client_cert, "key": tls.client_key, "connect_timeout": 5}
        _rendezvous_once(_params(cluster.endpoint("etcds"), **conf))
        _rendezvous_once(_params(cluster.endpoint("https"), run_id="sec2", **conf))
        # Without the client certificate the server refuses the handshake: a clear error, not a hang.
        with pytest.raises(Exception, match="etcd"):
            create_rdzv_handler(_params(cluster.endpoint(), cacert=tls.ca, connect_timeout=3))
    finally:
        cluster.stop()


def test_auth_with_a_role_on_the_prefix(etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    etcd.enable_auth("rootpw", "ezuser", "ezpw", "/elasticzero/")
    monkeypatch.setenv(PASSWORD_ENV, "ezpw")
    conf = {"user": "ezuser", "password_env": PASSWORD_ENV}
    _rendezvous_once(_params(etcd.endpoint(), **conf))
    # The shutdown revoked the lease: nothing is left under the run's prefix.
    assert etcd.etcdctl("get", "--prefix", "--keys-only", "/elasticzero/sec", user="root:rootpw").strip() == ""

    monkeypatch.setenv(PASSWORD_ENV, "wrong")
    with pytest.raises(EtcdAccessError, match=r"INVALID_ARGUMENT|authentication failed"):
        create_rdzv_handler(_params(etcd.endpoint(), **conf))

    monkeypatch.setenv(PASSWORD_ENV, "ezpw")
    with pytest.raises(EtcdAccessError, match="PERMISSION_DENIED"):
        create_rdzv_handler(_params(etcd.endpoint(), prefix="/elsewhere", **conf))

    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(UsageError, match=PASSWORD_ENV):
        create_rdzv_handler(_params(etcd.endpoint(), **conf))


def test_auth_survives_a_server_restart(etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted member forgets simple auth tokens: the client authenticates again by itself."""
    etcd.enable_auth("rootpw", "ezuser", "ezpw", "/elasticzero/")
    monkeypatch.setenv(PASSWORD_ENV, "ezpw")
    handler = create_rdzv_handler(_params(etcd.endpoint(), user="ezuser", password_env=PASSWORD_ENV))
    info = handler.next_rendezvous()
    info.store.set("before", "1")
    etcd.kill(0)
    etcd.restart(0)
    assert info.store.get("before") == b"1"
    assert handler.shutdown()
