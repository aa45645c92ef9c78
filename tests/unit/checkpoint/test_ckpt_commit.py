"""The checkpoint directory's pure decisions (checkpoint/commit.py): which directory is committed and latest, what
keep_last deletes, what makes a manifest unusable; and the commit I/O on a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticzero.checkpoint import commit, digest
from elasticzero.errors import UsageError


def test_classify_only_named_directories_with_a_manifest_are_committed() -> None:
    listing = commit.classify(
        [
            ("step-00000010", True),
            ("step-00000020", True),
            ("step-00000030.tmp-ab12", False),  # a save in flight or crashed
            ("step-00000005.del-cd34", True),  # a deletion in progress
            ("step-00000040", False),  # no manifest: never produced by the protocol, not trusted
            ("tensorboard", False),
        ]
    )
    assert listing.committed == {10: "step-00000010", 20: "step-00000020"}
    assert listing.aside == ["step-00000005.del-cd34", "step-00000030.tmp-ab12", "step-00000040"]
    assert commit.latest_step(listing) == 20
    assert commit.latest_step(commit.classify([])) is None


def test_to_delete_keeps_the_newest_k_and_the_just_committed() -> None:
    listing = commit.classify([(commit.step_dir(s), True) for s in (1, 2, 3, 4)] + [("step-00000009.tmp-ff", False)])
    assert commit.to_delete(listing, 2, 4) == ["step-00000001", "step-00000002", "step-00000009.tmp-ff"]
    assert commit.to_delete(listing, 1, 4) == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
        "step-00000009.tmp-ff",
    ]
    # a job resumed from an older step saves below a newer leftover: the one it just committed survives
    assert "step-00000002" not in commit.to_delete(listing, 1, 2)
    with pytest.raises(UsageError, match="keep_last must be >= 1"):
        commit.to_delete(listing, 0, 4)


def test_manifest_errors() -> None:
    good = {"format": commit.FORMAT_VERSION, "step": 3, "world_size": 2, "files": {".metadata": {}}}
    assert commit.manifest_errors(good, "m") == []
    assert "unknown checkpoint format 7" in commit.manifest_errors({**good, "format": 7}, "m")[0]
    assert "no file list" in commit.manifest_errors({**good, "files": {}}, "m")[0]
    assert "'step' missing" in commit.manifest_errors({**good, "step": "3"}, "m")[0]
    assert commit.manifest_errors([], "m") == ["m: not a JSON object"]


def test_commit_publish_delete_on_disk(tmp_path: Path) -> None:
    for step in (1, 2):
        tmp = commit.tmp_dir(step, commit.new_token())
        (tmp_path / tmp).mkdir()
        (tmp_path / tmp / "data").write_bytes(b"x" * step)
        manifest = {"format": 1, "step": step, "world_size": 1, "files": {"data": {"size": step, "crc32": 0}}}
        final = commit.commit(tmp_path, tmp, step, manifest)
        commit.publish(tmp_path, step)
        assert json.loads((final / commit.MANIFEST).read_text())["step"] == step
    assert (tmp_path / commit.LATEST).read_text() == "step-00000002\n"
    listing = commit.list_dir(tmp_path)
    commit.delete(tmp_path, commit.to_delete(listing, 1, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    files = {"data": {"size": 2, "xxh3_64": digest.of_file(tmp_path / "step-00000002" / "data")}}
    assert commit.file_errors(tmp_path / "step-00000002", files, ["data"], check_digest=True) == []
    (tmp_path / "step-00000002" / "data").write_bytes(b"xy")
    problems = commit.file_errors(tmp_path / "step-00000002", files, ["data"], check_digest=True)
    assert "checksum (xxh3_64) differs" in problems[0]
    with pytest.raises(UsageError, match="unreadable manifest"):
        commit.read_manifest(tmp_path)
