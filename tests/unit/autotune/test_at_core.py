"""Autotuning's pure core: metrics, the tuning block, the space, dialects, experiments, journal, resources, schedule."""

from __future__ import annotations

import json
import os

import pytest

from elasticzero.autotune.dialect import apply_point, base_of, check_expressible, is_deepspeed, split_tuning
from elasticzero.autotune.experiment import Experiment, find_flag, mapped_entry, with_flag
from elasticzero.autotune.journal import Journal, replay
from elasticzero.autotune.metrics import Measurement, clearly_better, get_metric
from elasticzero.autotune.resources import Node, Request, Reservation, ResourceManager
from elasticzero.autotune.schedule import PORT_SPAN, decide, pick_port
from elasticzero.autotune.space import Base, Point, expand, parse_tuning
from elasticzero.errors import UsageError

# ------------------------------------------------------------------------------------------------ metrics


def test_metric_directions() -> None:
    assert get_metric("throughput").maximize and get_metric("flops").maximize
    assert not get_metric("latency").maximize and not get_metric("memory").maximize
    assert get_metric("latency").better(1.0, 2.0) and get_metric("throughput").better(2.0, 1.0)
    with pytest.raises(UsageError, match=r"unknown metric 'speed'; use one of throughput, flops, latency, memory"):
        get_metric("speed")


def test_noise_aware_comparison() -> None:
    thr = get_metric("throughput")
    noisy = Measurement.from_metrics({"throughput": 105.0, "throughput_stdev": 20.0, "steps": 4}, "throughput")
    assert noisy == Measurement(105.0, 10.0)
    assert not clearly_better(thr, noisy, Measurement(100.0))  # 5 < 2 standard errors
    assert clearly_better(thr, Measurement(130.0, 5.0), Measurement(100.0, 5.0))
    assert not clearly_better(thr, Measurement(100.5), Measurement(100.0), rel_floor=0.01)  # under the floor
    lat = get_metric("latency")
    assert clearly_better(lat, Measurement(1.0), Measurement(2.0)) and not clearly_better(
        lat, Measurement(2.0), Measurement(1.0)
    )
    assert Measurement.from_metrics({"throughput": float("nan")}, "throughput") is None
    assert Measurement.from_metrics({"latency": 1.0}, "throughput") is None


# ------------------------------------------------------------------------------------------------ tuning block


def test_tuning_block_defaults_and_deepspeed_aliases() -> None:
    spec = parse_tuning({"tuner_type": "gridsearch", "tuner_num_trials": 5, "enabled": True, "metric": "latency"}, "x")
    assert spec.tuner == "grid" and spec.max_trials == 5 and spec.metric.name == "latency"
    assert spec.ignored == (("enabled", "the tuner runs because you started it"),)
    assert parse_tuning(None, "x").tuner == "model_based"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"metrc": "latency"}, r"cfg.yaml: autotuning: unknown key 'metrc'; known keys: "),
        ({"metric": "speed"}, r"cfg.yaml: autotuning.metric: unknown metric 'speed'"),
        ({"space": {}}, r"autotuning.space: empty search space"),
        ({"space": {"stage": []}}, r"autotuning.space.stage: empty list"),
        ({"space": {"stages": [1]}}, r"unknown dimension 'stages'"),
        ({"space": {"stage": [4]}}, r"ZeRO stage must be 0, 1, 2 or 3, got 4"),
        ({"space": {"precision": ["fp8"]}}, r"precision must be one of fp32, bf16, fp16"),
        ({"space": {"prefetch": ["yes"]}}, r"must be true or false"),
        ({"tuner": "bayes"}, r"unknown tuner 'bayes'"),
        ({"timeout": -1}, r"autotuning.timeout: must be a number > 0"),
        ({"nodes": 0}, r"autotuning.nodes: must be a whole number >= 1"),
        ({"arg_mappings": {"micro_batch_size": "batch"}}, r"'batch' is not a flag"),
    ],
)
def test_bad_tuning_block(block: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_tuning(block, "cfg.yaml: autotuning")


# ------------------------------------------------------------------------------------------------ space


def test_expand_keeps_global_batch_and_stage3_only_options() -> None:
    spec = parse_tuning({"space": {"stage": [2, 3], "micro_batch": [1, 2, 3, 4], "prefetch": [True, False]}}, "x")
    points, skipped = expand(spec, Base(2, 1, 4, 16), world_size=2)
    assert all(p.micro_batch * p.accumulation * 2 == 16 for p in points)
    assert {p.prefetch for p in points if p.stage == 2} == {None}  # not multiplied for stages without it
    assert len([p for p in points if p.stage == 3]) == 3 * 2 and len([p for p in points if p.stage == 2]) == 3
    assert skipped == [
        (f"z{s}_mb3", "global batch 16 is not a multiple of micro batch 3 x world size 2") for s in (2, 3)
    ]
    assert Point(3, 2, 4, prefetch=False).name == "z3_mb2_ga4_pf0"


def test_expand_without_usable_point_is_an_error() -> None:
    spec = parse_tuning({"space": {"micro_batch": [3]}}, "x")
    with pytest.raises(UsageError, match="no usable point at global batch 8"):
        expand(spec, Base(1, 1, 4, 8), world_size=2)


def test_expand_defaults_to_the_base_config() -> None:
    spec = parse_tuning({"space": {"stage": [1, 2]}}, "x")
    points, _ = expand(spec, Base(1, 2, 2, None), world_size=2)
    assert [(p.stage, p.micro_batch, p.accumulation) for p in points] == [(1, 2, 2), (2, 2, 2)]


# ------------------------------------------------------------------------------------------------ dialects


def test_native_and_deepspeed_dialects() -> None:
    native = {"zero": {"stage": 1}, "micro_batch_size": 2, "accumulation_steps": 2, "autotuning": {"metric": "latency"}}
    rest, block = split_tuning(native)
    assert block == {"metric": "latency"} and "autotuning" not in rest and not is_deepspeed(native)
    assert base_of(rest, False, 2, "x") == Base(1, 2, 2, 8)
    p = Point(3, 4, 1, bucket_bytes=4096, precision="bf16", prefetch=False, reshard_after_forward=True)
    out = apply_point(native, p, False, None)
    assert "autotuning" not in out and native["zero"] == {"stage": 1}  # a copy; the trial never tunes again
    assert out["zero"] == {"stage": 3, "bucket_bytes": 4096, "prefetch": False, "reshard_after_forward": True}
    assert (out["micro_batch_size"], out["accumulation_steps"], out["precision"]) == (4, 1, {"dtype": "bf16"})

    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    assert is_deepspeed({**ds, "autotuning": {}}) and base_of(ds, True, 8, "x") == Base(2, 2, 1, 16)
    out = apply_point(ds, Point(3, 4, 2, bucket_bytes=4000, precision="fp16", prefetch=True), True, 16)
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert out["zero_optimization"]["reduce_bucket_size"] == 1000 and out["fp16"] == {"enabled": True}
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"]) == (
        4,
        2,
        16,
    )
    with pytest.raises(UsageError, match="reshard_after_forward has no DeepSpeed config key"):
        check_expressible(parse_tuning({"space": {"reshard_after_forward": [True]}}, "x"), True, "ds.json")


# ------------------------------------------------------------------------------------------------ experiments


def test_flags_are_rewritten_in_place_or_appended() -> None:
    args = ["--config", "a.yaml", "--lr=3", "--bs", "8"]
    assert find_flag(args, "--config") == "a.yaml" and find_flag(args, "--lr") == "3" and find_flag(args, "--x") is None
    assert with_flag(args, "--lr", "4") == ["--config", "a.yaml", "--lr=4", "--bs", "8"]
    assert with_flag(args, "--bs", "2")[-1] == "2" and with_flag(args, "--new", "1")[-2:] == ["--new", "1"]
    cfg = {"micro_batch_size": 4, "zero": {"stage": 3}}
    entry = mapped_entry(["t.py", "--bs", "8"], cfg, {"micro_batch_size": "--bs", "zero.stage": "--zero"})
    assert entry == ("t.py", "--bs", "4", "--zero", "3")
    with pytest.raises(UsageError, match="config key 'nope' is not set"):
        mapped_entry(["t.py"], cfg, {"nope": "--x"})


def test_experiment_key_is_canonical() -> None:
    def exp(config: dict, steps: int = 10) -> Experiment:
        return Experiment(Point(1, 2, 2), config, ("t.py",), 1, 2, 3, steps)

    assert exp({"a": 1, "b": {"c": 2}}).key == exp({"b": {"c": 2}, "a": 1}).key  # key order does not matter
    assert exp({"a": 1}).key != exp({"a": 2}).key and exp({"a": 1}).key != exp({"a": 1}, steps=30).key
    rec = exp({"a": 1}).to_record()
    assert {"name", "config", "arg_mappings", "num_nodes", "num_gpus"} <= set(rec)


# ------------------------------------------------------------------------------------------------ journal


def test_journal_resumes_and_requeues(tmp_path) -> None:
    j = Journal(tmp_path / "journal.jsonl")
    j.append({"event": "start", "key": "a", "name": "A", "job_id": "j1", "hosts": ["localhost"]})
    j.append({"event": "finish", "key": "a", "name": "A", "outcome": {"status": "ok"}})
    j.append({"event": "start", "key": "b", "name": "B", "job_id": "j2", "hosts": ["localhost"]})
    with open(j.path, "a") as f:
        f.write('{"event": "fini')  # the tuner died mid-write
    state = j.load()
    assert state.finished == {"a": {"status": "ok"}} and list(state.interrupted) == ["b"] and state.order == ["a"]
    j.append({"event": "finish", "key": "b", "name": "B", "outcome": {"status": "oom"}})  # a clean line again
    assert set(j.load().finished) == {"a", "b"} and not j.load().interrupted
    aside = j.start_fresh()
    assert aside is not None and aside.exists() and not j.path.exists() and not j.load().finished


def test_journal_rejects_a_corrupt_middle_line() -> None:
    with pytest.raises(UsageError, match=r"journal:1: not a JSON line; move the journal aside or use --fresh"):
        replay(["garbage", json.dumps({"event": "start", "key": "a"})])
    with pytest.raises(UsageError, match=r"journal:1: unknown event 'begin'"):
        replay([json.dumps({"event": "begin", "key": "a"})])


def test_journal_lines_are_fsynced_appends(tmp_path, monkeypatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    Journal(tmp_path / "j.jsonl").append({"event": "start", "key": "k"})
    assert synced and json.loads((tmp_path / "j.jsonl").read_text())["key"] == "k"


# ------------------------------------------------------------------------------------------------ resources, schedule


def _pool(share: bool = False) -> ResourceManager:
    return ResourceManager.from_pool({"n1": (0, 1, 2, 3), "n2": (0, 1), "n3": (0, 1)}, share_hosts=share)


def test_reservation_is_exact_hostfile_and_include() -> None:
    r = Reservation((Node("n1", (2, 3)), Node("fe80::1", (0,))))
    assert r.hostfile() == "n1 slots=4\nfe80::1 slots=1\n" and r.include() == "n1:2,3@[fe80::1]:0"
    assert r.world_size == 3 and r.hosts == ("n1", "fe80::1")


def test_request_larger_than_pool_is_refused() -> None:
    rm = _pool()
    assert rm.default_request(None, None) == Request(3, 2)
    rm.check(Request(1, 4))
    with pytest.raises(UsageError, match=r"needs 2 node\(s\) x 4 slot\(s\) but the pool has n1:4, n2:2, n3:2"):
        rm.check(Request(2, 4))


def test_one_experiment_per_host_unless_shared() -> None:
    rm = _pool()
    queue = [(k, Request(1, 2)) for k in "abcd"]
    starts, counter = decide(queue, rm, running=0, max_running=None, base_port=30000, port_counter=0, ports_in_use=())
    assert [(s.key, s.reservation.hosts, s.port) for s in starts] == [
        ("a", ("n1",), 30000),
        ("b", ("n2",), 30001),
        ("c", ("n3",), 30002),
    ]  # d waits: every host is busy, and n1's two free slots would share n1's cores with a
    assert counter == 3
    shared = decide(
        queue, _pool(share=True), running=0, max_running=None, base_port=1, port_counter=0, ports_in_use=()
    )[0]
    assert [(s.key, s.reservation.nodes) for s in shared][:2] == [
        ("a", (Node("n1", (0, 1)),)),
        ("b", (Node("n1", (2, 3)),)),
    ]


def test_decide_is_pure_and_first_come_first_served() -> None:
    rm = _pool()
    rm.reserve(Reservation((Node("n1", (0,)),)))
    queue = [("big", Request(2, 2)), ("small", Request(1, 1))]
    starts, _ = decide(queue, rm, running=1, max_running=None, base_port=1, port_counter=0, ports_in_use=())
    assert [s.key for s in starts] == ["big"] and starts[0].reservation.hosts == ("n2", "n3")
    assert rm.find(Request(2, 2)) is not None  # decide reserved nothing
    rm.reserve(starts[0].reservation)
    assert decide(queue, rm, running=2, max_running=None, base_port=1, port_counter=0, ports_in_use=())[0] == []
    with pytest.raises(RuntimeError, match="already reserved"):
        rm.reserve(starts[0].reservation)
    rm.release(starts[0].reservation)
    assert decide(queue, rm, running=1, max_running=1, base_port=1, port_counter=0, ports_in_use=())[0] == []


def test_ports_round_robin_skip_ports_in_use() -> None:
    assert pick_port(30000, 0, {30000, 30001}) == (30002, 3)
    assert pick_port(30000, PORT_SPAN - 1, ()) == (30000 + PORT_SPAN - 1, PORT_SPAN)
    assert pick_port(30000, PORT_SPAN, ()) == (30000, PORT_SPAN + 1)
