"""Hostfile parsing: the accepted format and every rejected input with its file:line message."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.hostfile import host_key, is_loopback, normalize_host, parse_hostfile, read_hostfile


def test_hosts_in_file_order_with_comments_and_blank_lines() -> None:
    text = "# cluster\n\nworker-1 slots=4  # trailing comment\n  worker-0\tslots=2\n\n10.0.0.7 slots=1\n"
    pool = parse_hostfile(text, "hf")
    assert list(pool) == ["worker-1", "worker-0", "10.0.0.7"]
    assert pool["worker-1"] == (0, 1, 2, 3)
    assert pool["worker-0"] == (0, 1)
    assert pool["10.0.0.7"] == (0,)


@pytest.mark.parametrize("host", ["::1", "[::1]", "fe80::0001", "[2001:db8::1]", "fe80::2%eth0", "::ffff:10.0.0.1"])
def test_ipv6_literals_are_refused_with_the_fix(host: str) -> None:
    """No shipped transport can reach an IPv6 literal (pdsh -w, mpirun -H, Slurm lists read ':'): refused up front."""
    with pytest.raises(UsageError) as err:
        parse_hostfile(f"w0 slots=1\n{host} slots=2\n", "/x/hostfile")
    msg = str(err.value)
    assert msg.startswith(f"/x/hostfile:2: IPv6 address {host!r} cannot be a host")
    assert "give it a name in /etc/hosts" in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("w0 slots=2\nw0 slots=2\n", 2, "duplicate host 'w0' (first at line 1)"),
        ("w0 slots=2\nW0 slots=1\n", 2, "duplicate host"),
        ("w0 slots=0\n", 1, "slots=0 must be a positive integer"),
        ("w0 slots=-2\n", 1, "slots=-2 must be a positive integer"),
        ("w0 slots=four\n", 1, "slots='four' is not a number"),
        ("w0 slots=\n", 1, "slots='' is not a number"),
        ("\n\nw0 gpus=4\n", 3, "unknown key 'gpus'"),
        ("w0 slots=2 max_slots=4\n", 1, "unknown key 'max_slots'"),
        ("w0 slots=1 slots=2\n", 1, "'slots' given twice"),
        ("w0\n", 1, "missing slots=N for 'w0'"),
        ("w0 4\n", 1, "unexpected '4'"),
        ("slots=4\n", 1, "must start with a host name"),
        ("alice@w0 slots=2\n", 1, "'user@host' is not supported"),
        ("-oProxyCommand=x slots=1\n", 1, "must start with a host name"),
        ("-w0 slots=1\n", 1, "starts with '-'"),
        ("w$(id) slots=1\n", 1, "invalid host name"),
        ("fe80::zz slots=1\n", 1, "not a valid IPv6 address"),
        ("[w0] slots=1\n", 1, "invalid host name"),
        ("w0- slots=1\n", 1, "invalid host name"),  # the backends' rule (one regex): no trailing '-' or '.'
        ("w0. slots=1\n", 1, "invalid host name"),
    ],
)
def test_bad_lines_name_file_and_line(text: str, line: int, words: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_hostfile(text, "/x/hostfile")
    msg = str(err.value)
    assert msg.startswith(f"/x/hostfile:{line}: ")
    assert words in msg
    assert "\n" not in msg


@pytest.mark.parametrize("text", ["", "\n\n", "# only comments\n   # and more\n"])
def test_empty_hostfile_is_an_error(text: str) -> None:
    with pytest.raises(UsageError, match=r"^hf: hostfile has no hosts; add lines like 'worker-0 slots=4'$"):
        parse_hostfile(text, "hf")


def test_missing_hostfile_is_an_error_not_localhost(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(UsageError, match=r"hostfile '.*nope' not found; fix the path"):
        read_hostfile(missing)


def test_read_hostfile_reads_the_file(tmp_path: Path) -> None:
    f = tmp_path / "hostfile"
    f.write_text("a slots=1\nb slots=3\n")
    assert read_hostfile(f) == {"a": (0,), "b": (0, 1, 2)}


@pytest.mark.parametrize(
    ("host", "expected"),
    [("node-1.example", "node-1.example"), ("[::1]", "::1"), ("::1", "::1"), ("a b", None), ("[x]", None)],
)
def test_normalize_host(host: str, expected: str | None) -> None:
    assert normalize_host(host) == expected


@pytest.mark.parametrize(
    "host",
    ["localhost", "LocalHost", "localhost.", "localhost.localdomain", "node.localhost", "ip6-localhost",
     "127.0.0.1", "127.1.2.3", "::1", "[::1]", "0:0::1", "::ffff:127.0.0.1"],
)  # fmt: skip
def test_loopback_hosts_are_recognised_by_text(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host", ["worker-0", "localhost-1", "mylocalhost", "10.0.0.1", "128.0.0.1", "fe80::1", "::ffff:10.0.0.1", "a;b"]
)
def test_routable_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_host_key_folds_case_and_normalises_ipv6() -> None:
    assert host_key("Worker-0") == host_key("worker-0") == "worker-0"
    assert host_key("[FE80::0001]") == host_key("fe80::1") == "fe80::1"
