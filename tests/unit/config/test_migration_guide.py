"""The migration table in docs/engine.md ("Migrating from DeepSpeed") is the loader's own: every key it lists, with
its verdict, is what :func:`elasticzero.config.deepspeed.key_verdicts` says, and it lists every key the loader
knows. And the verdicts hold when a config is loaded: each key, at a value the row calls harmless or not, lands in
the report's list the table names."""

from __future__ import annotations

import re

import pytest

from elasticzero.config.deepspeed import key_verdicts, map_deepspeed
from ez_testing import REPO

VERDICTS = {"mapped": "mapped", "ignored": "ignored", "refused": "refused", "by value": "depends"}


def _guide_table() -> dict[str, str]:
    text = (REPO / "docs" / "engine.md").read_text()
    start = text.index("### Migrating from DeepSpeed")
    section = text[start : text.index("#### Worked examples", start)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)` \| ([a-z /]+) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is listed twice"
            rows[m.group(1)] = VERDICTS[m.group(2).strip()]
    return rows


def test_the_guide_lists_every_key_the_loader_knows_with_its_verdict() -> None:
    guide, loader = _guide_table(), key_verdicts()
    assert sorted(set(loader) - set(guide)) == [], "known to the loader, missing from docs/engine.md"
    assert sorted(set(guide) - set(loader)) == [], "in docs/engine.md, unknown to the loader"
    assert {k: v for k, v in guide.items() if loader[k] != v} == {}, "verdicts that differ"


def _config(key: str, value: object) -> dict[str, object]:
    """A config holding ``key`` (dotted) at ``value``, inside the sections it needs."""
    *parents, leaf = key.split(".")
    node: dict[str, object] = {leaf: value}
    for p in reversed(parents):
        node = {p: node}
    return node


@pytest.mark.parametrize(
    ("key", "value", "lands_in"),
    [
        ("zero_optimization.zero_quantized_weights", False, "ignored"),
        ("zero_optimization.zero_quantized_weights", True, "unsupported"),
        ("prescale_gradients", True, "unsupported"),
        ("bf16.check_grad_overflow", False, "ignored"),
        ("zero_optimization.zenflow", {"topk_ratio": 0.1}, "unsupported"),
        ("zero_optimization.leaf_module", {"classes": ["Block"]}, "ignored"),
        ("activation_checkpointing.profile", True, "ignored"),
        ("timers", {"throughput": {"enabled": True}}, "ignored"),
        ("pipeline", {"stages": 2}, "unsupported"),
    ],
)
def test_a_key_lands_where_its_row_says(key: str, value: object, lands_in: str) -> None:
    _, report = map_deepspeed(_config(key, value), world_size=1)
    assert key in dict(getattr(report, lands_in)), report.format()
