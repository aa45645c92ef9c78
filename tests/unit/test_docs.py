"""The user docs name every flag the command-line tools accept (dash spelling), so docs and code cannot drift."""

from __future__ import annotations

import argparse

import pytest

from ez_testing import REPO


def _long_dash_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:  # argparse has no public accessor
        dashed = [o for o in action.option_strings if o.startswith("--") and "_" not in o]
        if dashed and "--help" not in dashed:
            flags.add(dashed[0])
    return flags


def _launch_flags() -> set[str]:
    from elasticzero.launch.args import build_parser

    return _long_dash_flags(build_parser())


def _agent_flags() -> set[str]:
    from elasticzero.agent.options import add_agent_flags

    parser = argparse.ArgumentParser()
    add_agent_flags(parser)
    return _long_dash_flags(parser)


def _checkpoint_flags() -> set[str]:
    """Every sub-command of ``elasticzero-checkpoint`` and every flag of each."""
    from elasticzero.checkpoint.cli import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(subs.choices) | {f for sub in subs.choices.values() for f in _long_dash_flags(sub)}


@pytest.mark.parametrize(
    ("doc", "flags"),
    [
        ("docs/launching.md", _launch_flags),
        ("docs/agent.md", _agent_flags),
        ("docs/checkpointing.md", _checkpoint_flags),
    ],
    ids=["elasticzero-launch", "elasticzero-run", "elasticzero-checkpoint"],
)
def test_every_flag_is_documented(doc: str, flags) -> None:
    text = (REPO / doc).read_text()
    wanted = flags()
    assert wanted, "no flags found: the parser import is broken"
    missing = sorted(f for f in wanted if f not in text)
    assert not missing, f"{doc} does not mention: {', '.join(missing)}"


def test_every_flag_of_the_example_job_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """``examples/train_gpt.py``'s flags are in docs/elastic-training.md (the flags the README and docs name stay)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # as Python does for the script: its gpt.py beside it
    import train_gpt

    wanted = _long_dash_flags(train_gpt.parser())
    text = (REPO / "docs" / "elastic-training.md").read_text()
    assert {"--config", "--steps", "--checkpoint-dir", "--cache-dir"} <= wanted
    missing = sorted(f for f in wanted if f"`{f}" not in text)
    assert not missing, f"docs/elastic-training.md does not mention: {', '.join(missing)}"
