"""docs/autotuning.md names every flag of elasticzero-autotune's own group and every tuning-block key."""

from __future__ import annotations

from dataclasses import fields

from elasticzero.autotune.space import DIMS, TuningSpec
from ez_testing import REPO


def test_flags_and_keys_are_documented() -> None:
    import argparse

    from elasticzero.autotune.cli import add_tuning_flags

    parser = argparse.ArgumentParser()
    add_tuning_flags(parser)
    text = (REPO / "docs/autotuning.md").read_text()
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"]
    keys = [f"`{f.name}`" for f in fields(TuningSpec) if f.name != "ignored"] + [f"`{d}`" for d in DIMS]
    missing = [x for x in flags + keys if x not in text]
    assert flags and not missing, f"docs/autotuning.md does not mention: {missing}"
