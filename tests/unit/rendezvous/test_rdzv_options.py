"""``--rdzv-conf`` parsing: values, aliases, precedence and one-line errors."""

from __future__ import annotations

import pytest

from elasticzero.errors import UsageError
from elasticzero.rendezvous.options import DEFAULT_PASSWORD_ENV, parse_options


def test_defaults_leave_torch_timeouts_alone() -> None:
    opts = parse_options({})
    assert opts.join_timeout is None and opts.last_call_timeout is None
    assert (opts.keep_alive_interval, opts.keep_alive_max_attempt) == (5, 3)
    assert opts.etcd.password_env == DEFAULT_PASSWORD_ENV and opts.etcd.prefix == "/elasticzero"


def test_timeout_is_an_alias_of_join_timeout() -> None:
    assert parse_options({"timeout": 900}).join_timeout == 900
    assert parse_options({"timeout": "42"}).join_timeout == 42


def test_explicit_join_timeout_wins_over_timeout() -> None:
    assert parse_options({"timeout": 900, "join_timeout": "30"}).join_timeout == 30


def test_all_timeouts_and_keep_alive() -> None:
    opts = parse_options(
        {
            "last_call_timeout": "2",
            "close_timeout": "3",
            "heartbeat_timeout": "4",
            "keep_alive_interval": "1",
            "keep_alive_max_attempt": "7",
            "node_rank_hint": "5",
        }
    )
    assert (opts.last_call_timeout, opts.close_timeout, opts.heartbeat_timeout) == (2, 3, 4)
    assert (opts.keep_alive_interval, opts.keep_alive_max_attempt, opts.node_rank_hint) == (1, 7, 5)


def test_etcd_options() -> None:
    opts = parse_options({"cacert": "/ca.pem", "cert": "/c.pem", "key": "/k.pem", "user": "u", "prefix": "x/y/"})
    assert (opts.etcd.cacert, opts.etcd.cert, opts.etcd.key, opts.etcd.user) == ("/ca.pem", "/c.pem", "/k.pem", "u")
    assert opts.etcd.prefix == "/x/y"


@pytest.mark.parametrize(
    ("conf", "needle"),
    [
        ({"join_timout": "5"}, "unknown --rdzv-conf key(s)"),
        ({"join_timeout": "soon"}, "join_timeout='soon' is not an integer"),
        ({"last_call_timeout": "0"}, "must be >= 1"),
        ({"timeout": "-1"}, "timeout=-1 must be >= 1"),
        ({"node_rank_hint": "-2"}, "node_rank_hint=-2 must be >= 0"),
        ({"is_host": "maybe"}, "not a boolean"),
        ({"password": "hunter2"}, DEFAULT_PASSWORD_ENV),
        ({"cert": "/c.pem"}, "cert= and key= go together"),
        ({"lease_ttl": "6", "keep_alive_interval": "5"}, "twice keep_alive_interval"),
        ({"store_type": "file"}, "tcp only"),
        ({"connect_timeout": "0"}, "must be > 0"),
        ({"prefix": "/"}, "etcd root"),
        ({"keep_alive_max_attempt": "2"}, "keep_alive_max_attempt=2 must be >= 3"),
        ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt=0 must be >= 3: a live node's heartbeat"),
    ],
)
def test_bad_values_are_one_line_usage_errors(conf: dict[str, str], needle: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_options(conf)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)
    assert "hunter2" not in str(err.value)
