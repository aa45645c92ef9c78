"""Real etcd fixtures (``tests/cluster/etcd_server.py``) for the etcd semantics tests."""

from cluster.etcd_server import etcd, etcd3, etcd_any  # noqa: F401
