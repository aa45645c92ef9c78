"""``--include``/``--exclude`` filters and ``--num-nodes``/``--num-gpus`` selection over a resource pool.

Filter syntax (DeepSpeed's): ``NODE[:SLOT[,SLOT…]][@NODE[:SLOT[,SLOT…]]…]``.

* ``-i worker-0`` keeps every slot of worker-0; ``-i worker-0:0,1@worker-1`` keeps slots 0 and 1 of worker-0 and
  all of worker-1; ``-e worker-0:3`` removes slot 3; ``-e worker-1`` removes the host.
* IPv6 hosts are bracketed: ``[fe80::1]:0,1`` or ``[fe80::1]``; an unbracketed IPv6 literal is an error because
  its colons are ambiguous.
* The same host twice in one filter merges its slots (a bare host wins: all slots).
* Host names match the pool case-insensitively, IPv6 literals after normalisation (the rule the hostfile uses for
  duplicates): ``-i worker-0`` selects ``Worker-0``; the plan keeps the pool's spelling.

Differences from DeepSpeed (bugs fixed): unknown hosts and slots the host does not have are errors; ``-i`` with
``-e`` is an error; node order always follows the pool (hostfile) order, never the filter order; ``--num-gpus``
keeps the first N *remaining* slot ids of each host (DeepSpeed reset them to ``0…N-1``), and asking for more nodes
or slots than remain is an error instead of a silent shrink.

Everything here is a pure function over :data:`~elasticzero.launch.hostfile.ResourcePool`.
"""

from __future__ import annotations

from elasticzero.errors import UsageError
from elasticzero.launch.hostfile import ResourcePool, host_key, host_problem, normalize_host

#: host -> requested slot ids, or ``None`` for the whole host
FilterSpec = dict[str, "tuple[int, ...] | None"]


def _merge(old: tuple[int, ...] | None, new: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Two requests for one host: ``None`` (the whole host) wins, otherwise the union of the slots."""
    return None if old is None or new is None else tuple(sorted(set(old) | set(new)))


def parse_filter(expr: str, flag: str) -> FilterSpec:
    """Parse a filter expression given to ``flag`` (``-i``/``-e``, used in messages).

    Hosts are keyed by their first spelling in ``expr``; later spellings of the same host (any case) merge into it.
    """
    spec: FilterSpec = {}
    spelling: dict[str, str] = {}
    if not expr.strip():
        raise UsageError(f"{flag} needs a value like 'worker-0' or 'worker-0:0,1@worker-1'")
    for term in expr.split("@"):
        host, slots = _parse_term(term, expr, flag)
        first = spelling.setdefault(host_key(host), host)
        spec[first] = _merge(spec[first], slots) if first in spec else slots
    return spec


def _parse_term(term: str, expr: str, flag: str) -> tuple[str, tuple[int, ...] | None]:
    if not term:
        raise UsageError(f"{flag} {expr!r}: empty node between '@'; write NODE[:SLOT,…]@NODE…")
    if term.startswith("["):
        close = term.find("]")
        if close < 0:
            raise UsageError(f"{flag} {expr!r}: missing ']' in {term!r}; write IPv6 hosts as [fe80::1]:0,1")
        host_text, rest = term[: close + 1], term[close + 1 :]
        if rest and not rest.startswith(":"):
            raise UsageError(f"{flag} {expr!r}: unexpected {rest!r} after {host_text}; write [ADDR]:0,1")
        slot_text: str | None = rest[1:] if rest else None
    elif term.count(":") > 1:
        raise UsageError(f"{flag} {expr!r}: IPv6 hosts must be bracketed in filters, e.g. [fe80::1] or [fe80::1]:0,1")
    else:
        host_text, colon, after = term.partition(":")
        slot_text = after if colon else None
    host = normalize_host(host_text)
    if host is None:
        raise UsageError(f"{flag} {expr!r}: {host_problem(host_text)}")
    if slot_text is None:
        return host, None
    return host, _parse_slots(slot_text, host_text, expr, flag)


def _parse_slots(text: str, host: str, expr: str, flag: str) -> tuple[int, ...]:
    slots: list[int] = []
    for item in text.split(","):
        if not item.isdigit() or not item.isascii():
            raise UsageError(
                f"{flag} {expr!r}: bad slot {item!r} for {host}; slots are non-negative integers, e.g. {host}:0,1"
            )
        slots.append(int(item))
    return tuple(sorted(set(slots)))


def _resolve(spec: FilterSpec, pool: ResourcePool, flag: str, expr: str, source: str) -> FilterSpec:
    """``spec`` keyed by the pool's spelling of each host; unknown hosts and missing slots are errors."""
    by_key = {host_key(h): h for h in pool}
    out: FilterSpec = {}
    for host, slots in spec.items():
        known = by_key.get(host_key(host))
        if known is None:
            listed = ", ".join(list(pool)[:8]) + (", …" if len(pool) > 8 else "")
            raise UsageError(f"{flag} {expr!r}: unknown host {host!r}; {source} has: {listed}")
        missing = [s for s in slots or () if s not in pool[known]]
        if missing:
            have = ",".join(map(str, pool[known]))
            raise UsageError(
                f"{flag} {expr!r}: host {known!r} has no slot {missing[0]}; its slots are {have} ({source})"
            )
        out[known] = _merge(out[known], slots) if known in out else slots
    return out


def apply_filters(
    pool: ResourcePool, include: str | None, exclude: str | None, source: str = "hostfile"
) -> ResourcePool:
    """The pool after ``--include`` or ``--exclude`` (at most one of them), in pool order."""
    if include is not None and exclude is not None:
        raise UsageError("--include and --exclude cannot be combined; use one of them")
    if include is not None:
        spec = _resolve(parse_filter(include, "--include"), pool, "--include", include, source)
        kept_pool: ResourcePool = {}
        for host, slots in pool.items():
            if host in spec:
                wanted = spec[host]
                kept_pool[host] = slots if wanted is None else tuple(s for s in slots if s in wanted)
        return kept_pool
    if exclude is not None:
        spec = _resolve(parse_filter(exclude, "--exclude"), pool, "--exclude", exclude, source)
        out: ResourcePool = {}
        for host, slots in pool.items():
            drop = spec.get(host, ())
            kept = () if host in spec and drop is None else tuple(s for s in slots if s not in (drop or ()))
            if kept:
                out[host] = kept
        if not out:
            raise UsageError(f"--exclude {exclude!r} removes every slot; nothing left to launch")
        return out
    return dict(pool)


def select_first(
    pool: ResourcePool, num_nodes: int | None, num_gpus: int | None, source: str = "hostfile"
) -> ResourcePool:
    """Keep the first ``num_nodes`` hosts and the first ``num_gpus`` slots of each (``None`` = all)."""
    out = dict(pool)
    if num_nodes is not None:
        if num_nodes < 1:
            raise UsageError(f"--num-nodes {num_nodes} must be at least 1")
        if num_nodes > len(out):
            raise UsageError(
                f"--num-nodes {num_nodes} but only {len(out)} host(s) available ({source}, after filters); "
                "lower --num-nodes or add hosts"
            )
        out = dict(list(out.items())[:num_nodes])
    if num_gpus is not None:
        if num_gpus < 1:
            raise UsageError(f"--num-gpus {num_gpus} must be at least 1")
        for host, slots in out.items():
            if len(slots) < num_gpus:
                raise UsageError(
                    f"--num-gpus {num_gpus} but host {host!r} has only {len(slots)} slot(s) ({source}, after "
                    "filters); lower --num-gpus or change the filters"
                )
        out = {h: s[:num_gpus] for h, s in out.items()}
    return out
