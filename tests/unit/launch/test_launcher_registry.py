"""The launcher registry read without importlib.metadata (``backend.declared_launchers``) agrees with it."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from elasticzero.errors import UsageError
from elasticzero.launch.backend import ENTRY_POINT_GROUP, declared_launchers, launcher_class


def _dist(root: Path, dirname: str, text: str) -> None:
    info = root / dirname
    info.mkdir(parents=True)
    (info / "entry_points.txt").write_text(text)


def test_same_registry_as_importlib_metadata() -> None:
    """This environment's launchers (the shipped ones and any site plugin): same names, same targets."""
    expected = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert declared_launchers(sys.path) == expected
    assert {"local", "pdsh", "no-ssh"} <= expected.keys()
    for name in expected:
        assert launcher_class(name).name == name


def test_shadowing_sections_and_comments(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    _dist(
        first,
        "site_launchers-1.0.dist-info",
        "# comment\n[console_scripts]\nx = a:b\n\n[elasticzero.launchers]\n  mine = my.pkg:Mine [extra]\n",
    )
    _dist(second, "Site.Launchers-2.0.dist-info", "[elasticzero.launchers]\nmine = old:Old\nother = o:O\n")
    _dist(second, "other_dist-1.0.egg-info", "[elasticzero.launchers]\nlast = l:L\n")
    # the first distribution of a (normalised) name shadows later ones, as importlib.metadata does
    assert declared_launchers([str(first), str(second), str(tmp_path / "missing")]) == {
        "mine": "my.pkg:Mine [extra]",
        "last": "l:L",
    }


def test_unknown_name_lists_the_installed_ones() -> None:
    with pytest.raises(UsageError, match=r"unknown --launcher 'nope'; available: .*local.*pdsh"):
        launcher_class("nope")
