"""Endpoint parsing: which store an ``elasticzero`` endpoint selects."""

from __future__ import annotations

import pytest

from elasticzero.errors import UsageError
from elasticzero.rendezvous.endpoint import parse_endpoint


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1:29500", (("node1", 29500),)),
        ("tcp://10.0.0.1:1234", (("10.0.0.1", 1234),)),
        ("node1", (("node1", 29400),)),
        ("[::1]:7", (("::1", 7),)),
    ],
)
def test_c10d_endpoints(text: str, hosts: tuple[tuple[str, int], ...]) -> None:
    spec = parse_endpoint(text)
    assert (spec.kind, spec.hosts, spec.tls) == ("c10d", hosts, False)


def test_c10d_endpoint_form_for_torch() -> None:
    assert parse_endpoint("tcp://h:5").c10d_endpoint == "h:5"
    assert parse_endpoint("[::1]:7").c10d_endpoint == "[::1]:7"


def test_etcd_endpoints_keep_order_and_drop_duplicates() -> None:
    spec = parse_endpoint("etcd://a:1,b:2,a:1,c")
    assert (spec.kind, spec.hosts, spec.tls) == ("etcd", (("a", 1), ("b", 2), ("c", 2379)), False)


@pytest.mark.parametrize("scheme", ["etcds", "https"])
def test_tls_schemes(scheme: str) -> None:
    spec = parse_endpoint(f"{scheme}://a:1")
    assert spec.kind == "etcd" and spec.tls


@pytest.mark.parametrize("bad", ["", "ftp://a:1", "a:0", "a:x", "tcp://a:1,b:2", "etcd://a:1,,b:2", ":5"])
def test_bad_endpoints_raise_usage_error(bad: str) -> None:
    with pytest.raises(UsageError):
        parse_endpoint(bad)
