"""``--rdzv-conf`` options of the ``elasticzero`` rendezvous: parsing and validation (pure, no I/O).

Every key is checked: an unknown key or a bad value raises :class:`~elasticzero.errors.UsageError` with one line
naming the key and the fix. ``timeout`` (which torchrun always injects, 900 s unless ``--rdzv-timeout`` or
``--rdzv-conf timeout=`` says otherwise) is honoured as an alias of ``join_timeout``; an explicit ``join_timeout``
wins over it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticzero.errors import UsageError

DEFAULT_PASSWORD_ENV = "ELASTICZERO_ETCD_PASSWORD"
DEFAULT_PREFIX = "/elasticzero"

_SECONDS_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

KNOWN_KEYS = frozenset(
    {
        "timeout",
        *_SECONDS_KEYS,
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "node_rank_hint",
        # c10d (TCPStore) keys, as torch's c10d backend reads them
        "is_host",
        "read_timeout",
        "store_type",
        # etcd v3 keys
        "cacert",
        "cert",
        "key",
        "user",
        "password_env",
        "lease_ttl",
        "connect_timeout",
        "retry_timeout",
        "prefix",
    }
)


#: keys only an etcd endpoint reads, and keys only a c10d endpoint reads (:func:`misplaced_keys`)
ETCD_ONLY_KEYS = frozenset(
    {"cacert", "cert", "key", "user", "password_env", "lease_ttl", "connect_timeout", "retry_timeout", "prefix"}
)
C10D_ONLY_KEYS = frozenset({"is_host", "store_type"})


def misplaced_keys(kind: str, conf: Mapping[str, Any]) -> list[str]:
    """The keys of ``conf`` the store ``kind`` (``"c10d"`` or ``"etcd"``) never reads, sorted.

    The handler ignores them; a front-end that knows the endpoint refuses them (``user=`` without an etcd endpoint
    is a forgotten ``--rdzv-endpoint``, not a setting).
    """
    other = ETCD_ONLY_KEYS if kind == "c10d" else C10D_ONLY_KEYS
    return sorted(set(conf) & other)


@dataclass(frozen=True)
class EtcdOptions:
    """Connection and lease settings of the etcd v3 backend."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_env: str = DEFAULT_PASSWORD_ENV
    lease_ttl: int = 30
    connect_timeout: float = 10.0
    retry_timeout: float = 60.0
    prefix: str = DEFAULT_PREFIX


@dataclass(frozen=True)
class RendezvousOptions:
    """Everything the ``elasticzero`` handler reads from ``--rdzv-conf``; ``None`` timeouts mean torch's default."""

    join_timeout: int | None = None
    last_call_timeout: int | None = None
    close_timeout: int | None = None
    heartbeat_timeout: int | None = None
    keep_alive_interval: int = 5
    keep_alive_max_attempt: int = 3
    node_rank_hint: int | None = None
    is_host: bool | None = None
    read_timeout: int = 60
    etcd: EtcdOptions = EtcdOptions()


def _text(key: str, value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise UsageError(f"--rdzv-conf {key}= is empty")
    return text


def _int(key: str, value: Any, minimum: int, why: str = "") -> int:
    text = _text(key, value)
    try:
        number = int(text)
    except ValueError:
        raise UsageError(f"--rdzv-conf {key}={text!r} is not an integer") from None
    if number < minimum:
        raise UsageError(f"--rdzv-conf {key}={number} must be >= {minimum}{why}")
    return number


#: right after a round completes a live node's last heartbeat can be two intervals old (torch's keep-alive timer
#: restarts after the join): with 1 or 2 attempts it is dropped as dead (seen in ~1 test run in 10 under load)
_MAX_ATTEMPT_WHY = (
    ": a live node's heartbeat can be two keep_alive_interval old right after a round completes, "
    "and it would be dropped as dead"
)


def _float(key: str, value: Any) -> float:
    text = _text(key, value)
    try:
        number = float(text)
    except ValueError:
        raise UsageError(f"--rdzv-conf {key}={text!r} is not a number of seconds") from None
    if not number > 0:
        raise UsageError(f"--rdzv-conf {key}={text} must be > 0")
    return number


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(key, value).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UsageError(f"--rdzv-conf {key}={value!r} is not a boolean (use true or false)")


def _etcd_options(conf: Mapping[str, Any]) -> EtcdOptions:
    kw: dict[str, Any] = {}
    for name in ("cacert", "cert", "key", "user", "password_env"):
        if name in conf:
            kw[name] = _text(name, conf[name])
    if "lease_ttl" in conf:
        kw["lease_ttl"] = _int("lease_ttl", conf["lease_ttl"], 2)
    for name in ("connect_timeout", "retry_timeout"):
        if name in conf:
            kw[name] = _float(name, conf[name])
    if "prefix" in conf:
        prefix = "/" + _text("prefix", conf["prefix"]).strip("/")
        if prefix == "/":
            raise UsageError("--rdzv-conf prefix=/ would put the rendezvous at the etcd root; name a prefix")
        kw["prefix"] = prefix
    if ("cert" in kw) != ("key" in kw):
        raise UsageError("--rdzv-conf cert= and key= go together (client certificate and its private key)")
    return EtcdOptions(**kw)


def parse_options(conf: Mapping[str, Any]) -> RendezvousOptions:
    """Validate the rendezvous config mapping (``RendezvousParameters.config``) into :class:`RendezvousOptions`."""
    if "password" in conf:
        raise UsageError(
            "--rdzv-conf password= is refused (it would show in ps and logs); "
            f"put the etcd password in ${DEFAULT_PASSWORD_ENV} (or name another variable with password_env=)"
        )
    unknown = sorted(set(conf) - KNOWN_KEYS)
    if unknown:
        raise UsageError(
            f"unknown --rdzv-conf key(s) for the elasticzero rendezvous: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(KNOWN_KEYS))})"
        )
    kw: dict[str, Any] = {}
    for name in _SECONDS_KEYS:
        if name in conf:
            kw[name] = _int(name, conf[name], 1)
    if "join_timeout" not in kw and "timeout" in conf:
        kw["join_timeout"] = _int("timeout", conf["timeout"], 1)
    if "keep_alive_interval" in conf:
        kw["keep_alive_interval"] = _int("keep_alive_interval", conf["keep_alive_interval"], 1)
    if "keep_alive_max_attempt" in conf:
        kw["keep_alive_max_attempt"] = _int(
            "keep_alive_max_attempt", conf["keep_alive_max_attempt"], 3, _MAX_ATTEMPT_WHY
        )
    if "node_rank_hint" in conf:
        kw["node_rank_hint"] = _int("node_rank_hint", conf["node_rank_hint"], 0)
    if "is_host" in conf:
        kw["is_host"] = _bool("is_host", conf["is_host"])
    if "read_timeout" in conf:
        kw["read_timeout"] = _int("read_timeout", conf["read_timeout"], 1)
    if "store_type" in conf and _text("store_type", conf["store_type"]).lower() != "tcp":
        raise UsageError(f"--rdzv-conf store_type={conf['store_type']!r}: the elasticzero c10d store is tcp only")
    etcd = _etcd_options(conf)
    interval = kw.get("keep_alive_interval", 5)
    if etcd.lease_ttl < 2 * interval:
        raise UsageError(
            f"--rdzv-conf lease_ttl={etcd.lease_ttl} must be at least twice keep_alive_interval={interval}, "
            "or the rendezvous state could expire between heartbeats"
        )
    return RendezvousOptions(**kw, etcd=etcd)
