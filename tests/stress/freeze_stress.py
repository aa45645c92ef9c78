"""Stress: the freeze, store-host freeze, partition, node-restart, hung-worker, live hand-off, live comeback and live
example tests, each repeated, to show they are not races (a script, not collected by pytest: no ``test_`` files here).

Each repetition is one real pytest run of one case (fresh agents, fresh job id, fresh etcd server), so what is
repeated is exactly what CI runs. The failures' output is kept under ``--keep``; the timings the tests print (the
agents' part of a recovery, when the survivor trains again, when its first step is done) are collected.

    .venv/bin/python tests/stress/freeze_stress.py 10                      # every case 10 times
    .venv/bin/python tests/stress/freeze_stress.py 10 --case c10d-freeze   # one case

Prints one line per run and a summary: runs, passes, failures per case (with the failing assertion's line), the
median and range of each timing, and the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HANG = "tests/integration/elastic/test_hang.py"
LIVE = "tests/integration/agent/test_live_handoff.py::test_survivors_keep_their_workers_through_kill_join_and_freeze"
LIVE_E2E = "tests/integration/elastic/test_live_e2e.py"
STORE_FREEZE = "tests/integration/agent/test_store_host_freeze.py"
PARTITION = "tests/integration/launch/test_partition.py"
RESTART = "tests/integration/launch/test_node_restart.py::test_a_lost_node_is_started_again_and_rejoins"
LIVE_COMEBACK = (
    "tests/integration/launch/test_live_comeback.py::test_a_lost_node_comes_back_live_and_the_survivor_never_restarts"
)
CASES = {
    "c10d-freeze": "tests/integration/elastic/test_freeze.py::test_frozen_node_survived_fenced_and_rejoins[c10d]",
    "etcd-freeze": "tests/integration/elastic/test_freeze.py::test_frozen_node_survived_fenced_and_rejoins[etcd]",
    "c10d-store-host-freeze": f"{STORE_FREEZE}::test_the_store_hosts_freeze_stops_the_other_node_fast_and_it_rejoins",
    "etcd-cut-off-rejoin": f"{STORE_FREEZE}::test_an_agent_cut_off_from_etcd_stays_and_rejoins",
    "partition": f"{PARTITION}::test_a_partitioned_node_is_dropped_and_the_survivor_trains_on",
    "etcd-partition": f"{PARTITION}::test_the_first_host_cut_off_from_an_etcd_job_rejoins_and_the_job_trains_on",
    "node-restart-killed": f"{RESTART}[killed]",
    "node-restart-ssh": f"{RESTART}[ssh]",
    "live-partition": f"{LIVE_COMEBACK}[partition]",
    "live-killed": f"{LIVE_COMEBACK}[killed]",
    "c10d-store-call-window": "tests/integration/agent/test_store_call_bound.py",
    "worker-hang": f"{HANG}::test_a_worker_that_stops_making_progress_is_named_and_the_job_trains_on",
    "worker-stop": f"{HANG}::test_a_stopped_worker_is_named_and_the_job_trains_on",
    "c10d-live-handoff": f"{LIVE}[c10d]",
    "etcd-live-handoff": f"{LIVE}[etcd]",
    "c10d-live-e2e": f"{LIVE_E2E}::test_live_recovery_keeps_the_survivor_through_kill_join_and_freeze[c10d-zero2-fp32]",
    "etcd-live-e2e": f"{LIVE_E2E}::test_live_recovery_keeps_the_survivor_through_kill_join_and_freeze[etcd-zero3-bf16]",
    "two-buddies-live-e2e": f"{LIVE_E2E}::test_two_buddies_lost_at_once_fall_back_to_the_disk_checkpoint",
}
#: the lines the tests print, and the name each timing gets in the summary
TIMINGS = {
    "agents' part": re.compile(r"workers started ([\d.]+) s after the freeze"),
    "trains again": re.compile(r"trains again (?:at world 1 )?([\d.]+) s after the (?:freeze|cut)"),
    "first step": re.compile(r"first step done after ([\d.]+) s"),
    "store line": re.compile(r"said why ([\d.]+) s after the store host froze"),
    "back at world 2": re.compile(r"world 2 again ([\d.]+) s after the (?:store host resumed|heal)"),
    "hang → first step": re.compile(r"-> first step of the new attempt: ([\d.]+)s"),
    "live hand-off (kill)": re.compile(r"saw it ([\d.]+) s after the event"),
    "live example (kill)": re.compile(r"^kill: .* at world 1 ([\d.]+) s after it", re.M),
    "live example (freeze)": re.compile(r"^freeze: .* at world 1 ([\d.]+) s after it", re.M),
    "two lost → restarted step": re.compile(r"^two lost: .* ([\d.]+) s after the kill", re.M),
    "node restart → world 2": re.compile(r"node restart \(\w+\): world 2 again ([\d.]+) s after the loss"),
    "node restart: sshd back → world 2": re.compile(r"node restart \(killed\): world 2 again ([\d.]+) s after sshd"),
    "live: survivor at world 1": re.compile(r"^(?:partition|killed): the survivor .* ([\d.]+) s after it", re.M),
    "live: world 2 again": re.compile(r"^(?:partition|killed): world 2 again ([\d.]+) s after", re.M),
}


def run_once(nodeid: str, keep: Path, label: str) -> tuple[bool, str, dict[str, float]]:
    """One pytest run of ``nodeid``: passed?, the failing line, and the timings it printed."""
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", nodeid]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    out = p.stdout + p.stderr
    times = {name: float(m.group(1)) for name, rx in TIMINGS.items() if (m := rx.search(out))}
    if p.returncode == 0:
        return True, "", times
    log = keep / f"{label}-{time.strftime('%H%M%S')}.log"
    log.write_text(out)
    lines = out.splitlines()  # pytest marks the failing source line with ">", its message with "E"
    why = next((line[1:].strip() for line in lines if line.startswith(">")), f"exit {p.returncode}")
    return False, f"{why[:160]} (log: {log})", times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, help="repetitions per case")
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="only these cases (repeatable)")
    ap.add_argument("--keep", type=Path, default=None, help="where failing runs' output goes (default: a temp dir)")
    args = ap.parse_args()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="freeze-stress-"))
    keep.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[tuple[bool, str, dict[str, float]]]] = {c: [] for c in args.case or CASES}
    t0 = time.monotonic()
    for i in range(args.n):
        for case in results:
            ok, why, times = run_once(CASES[case], keep, case)
            results[case].append((ok, why, times))
            shown = " ".join(f"{k}={v:.2f}s" for k, v in times.items())
            print(f"[{i + 1}/{args.n}] {case}: {'ok' if ok else 'FAIL ' + why} {shown}", flush=True)
    print(f"\nsummary ({time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}):")
    for case, runs in results.items():
        fails = [why for ok, why, _ in runs if not ok]
        print(f"  {case}: {len(runs)} runs, {len(runs) - len(fails)} passed, {len(fails)} failed")
        for name in TIMINGS:
            values = [t[name] for _, _, t in runs if name in t]
            if values:
                print(f"    {name}: median {statistics.median(values):.2f} s [{min(values):.2f}, {max(values):.2f}]")
        for why in fails:
            print(f"    failed: {why}")
    return 0 if all(ok for runs in results.values() for ok, _, _ in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
