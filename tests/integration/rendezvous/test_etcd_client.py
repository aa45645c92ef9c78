"""The etcd client against real servers: failover, restart, unreachable endpoints, missing client module."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from rdzv_etcd_parts import client_for

from cluster.etcd_server import EtcdCluster
from elasticzero.rendezvous.etcd_client import EtcdClient, EtcdConnectionError, EtcdSettings
from ez_testing import free_port

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def _put(client: EtcdClient, key: bytes, value: bytes) -> None:
    put = client.rpc.RequestOp(request_put=client.rpc.PutRequest(key=key, value=value))
    client.txn([], [put], [])


def _value(client: EtcdClient, key: bytes) -> bytes | None:
    kvs = list(client.range(key).kvs)
    return bytes(kvs[0].value) if kvs else None


def test_fails_over_when_the_current_member_dies(etcd3: EtcdCluster) -> None:
    client = client_for(etcd3)
    try:
        _put(client, b"/t/a", b"1")
        etcd3.kill(client._current)
        _put(client, b"/t/b", b"2")
        assert (_value(client, b"/t/a"), _value(client, b"/t/b")) == (b"1", b"2")
    finally:
        client.close()


def test_reconnects_after_a_restart(etcd: EtcdCluster) -> None:
    client = client_for(etcd, retry_timeout=30)
    try:
        _put(client, b"/t/a", b"1")
        etcd.kill(0)
        failed_once, out = threading.Event(), []
        fail_over = client._fail_over

        def record_failure(ep: object) -> None:
            failed_once.set()
            fail_over(ep)  # type: ignore[arg-type]

        client._fail_over = record_failure  # type: ignore[method-assign]

        def read() -> None:
            try:
                out.append(_value(client, b"/t/a"))
            except Exception as exc:  # reported by the assertion below
                out.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert failed_once.wait(20)  # the read has hit the dead member at least once
        etcd.restart(0)  # only a retry through the outage can now succeed
        reader.join(60)
        assert out == [b"1"]
    finally:
        client.close()


def test_unreachable_endpoints_fail_fast_with_a_clear_error() -> None:
    dead = (("127.0.0.1", free_port()), ("127.0.0.1", free_port()))
    client = EtcdClient(EtcdSettings(hosts=dead, retry_timeout=1.5))  # gives up after 1.5 s of retries
    with pytest.raises(EtcdConnectionError, match=r"no etcd endpoint of http://127\.0\.0\.1:\d+,http://"):
        client.range(b"/x")
    client.close()


def test_missing_client_module_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['pyetcd'] = None; sys.modules['etcd3'] = None\n"
        "from elasticzero.rendezvous.etcd_client import load_etcd_module\n"
        "try:\n    load_etcd_module()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("UsageError")
    assert "pip install 'elasticzero[etcd]'" in out.stdout
