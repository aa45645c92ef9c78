"""Assertions shared by the torchrun tests: one world, consistent worker env."""

from __future__ import annotations

from collections.abc import Sequence


def assert_one_world(records: Sequence[dict[str, object]], nnodes: int, nproc: int, run_id: str) -> None:
    """Every worker saw the same world (size, master, run id) and the gloo all-reduce summed all ranks."""
    world = nnodes * nproc
    assert len(records) == world
    expected_sum = world * (world + 1) / 2
    masters = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}
    assert len(masters) == 1, f"workers disagree on the master: {masters}"
    group_ranks = sorted({int(str(r["GROUP_RANK"])) for r in records})
    assert group_ranks == list(range(nnodes))
    for rank, r in enumerate(records):
        assert int(str(r["RANK"])) == rank
        assert int(str(r["WORLD_SIZE"])) == world
        assert int(str(r["GROUP_WORLD_SIZE"])) == nnodes
        assert int(str(r["LOCAL_WORLD_SIZE"])) == nproc
        assert int(str(r["LOCAL_RANK"])) == rank % nproc
        assert int(str(r["GROUP_RANK"])) == rank // nproc
        assert r["TORCHELASTIC_RUN_ID"] == run_id
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert r["allreduce"] == expected_sum
