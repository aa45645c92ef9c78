"""Rendezvous time for 8, 16 and 32 agents: elasticzero-etcd and elasticzero-c10d vs torch's ``c10d``, side by side.

Not a test. Run from the repo root::

    .venv/bin/python bench/rendezvous_bench.py                # 8 16 32 agents, 3 repeats
    .venv/bin/python bench/rendezvous_bench.py --agents 8 --repeats 1

Method. An "agent" is one rendezvous handler obtained from torch's registry exactly as torchrun does
(``get_rendezvous_handler(RendezvousParameters(...))``) and driven through ``next_rendezvous()``; no workers are
started. To keep 32 agents feasible on a 2-core host the agents are spread over ``--procs`` real processes (default
4), each hosting ``agents / procs`` handlers in threads (every handler is its own node to torch: its own node
descriptor, heartbeats and state sync). Every process builds its handlers (connects to the store), reports ready,
then all start ``next_rendezvous()`` on one "go" signal. The figure is the time from "go" to the last agent's
return, i.e. until the whole world has formed (min = max = agents, so there is no last-call wait). The three
backends run interleaved in the same invocation, on the same host, with a fresh run id each time; the etcd is a
single-member etcd 3.4 on loopback started by this script. Ratios are elasticzero / torch c10d (< 1 = faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

BACKENDS = ("torch-c10d", "elasticzero-c10d", "elasticzero-etcd")


def _child(backend: str, endpoint: str, run_id: str, n_agents: int, n_local: int) -> None:
    """One process hosting ``n_local`` agents; prints ``ready``, waits for ``go`` on stdin, prints JSON results."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    name = "c10d" if backend == "torch-c10d" else "elasticzero"
    params = RendezvousParameters(
        name, endpoint, run_id, n_agents, n_agents, local_addr="127.0.0.1", join_timeout=300, read_timeout=300
    )
    handlers = [get_rendezvous_handler(params) for _ in range(n_local)]
    print("ready", flush=True)
    sys.stdin.readline()
    done: list[float] = []
    ranks: list[int] = []

    def join(handler: object) -> None:
        info = handler.next_rendezvous()  # type: ignore[attr-defined]
        done.append(time.time())
        ranks.append(info.rank)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"done": done, "ranks": ranks}), flush=True)
    sys.stdin.readline()  # "close": every process has finished its rendezvous
    for h in handlers:
        h.shutdown()
    print("closed", flush=True)
    sys.stdin.readline()  # "exit": every process has closed (one of them hosts the TCPStore the others use)


def _measure(backend: str, endpoint: str, run_id: str, n_agents: int, n_procs: int) -> float:
    """Seconds from "go" until the last of ``n_agents`` agents has completed the rendezvous."""
    n_procs = min(n_procs, n_agents)
    shares = [n_agents // n_procs + (1 if i < n_agents % n_procs else 0) for i in range(n_procs)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", backend, endpoint, run_id, str(n_agents), str(k)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in shares
    ]
    try:
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"{backend}: agent process failed to start (got {line!r})")
        go = time.time()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        results = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        for word in ("close", "exit"):
            for p in procs:
                p.stdin.write(word + "\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            if word == "close":
                for p in procs:
                    p.stdout.readline()  # type: ignore[union-attr]
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = sorted(r for res in results for r in res["ranks"])
    if ranks != list(range(n_agents)):
        raise RuntimeError(f"{backend}: agents did not form one world of {n_agents}: ranks {ranks}")
    return max(t for res in results for t in res["done"]) - go


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4, help="processes the agents are spread over")
    args = ap.parse_args()

    from cluster.etcd_server import EtcdCluster
    from ez_testing import free_port

    with tempfile.TemporaryDirectory(prefix="ez-rdzv-bench-") as tmp:
        etcd = EtcdCluster.start(Path(tmp) / "etcd", 1)
        try:
            times: dict[tuple[str, int], list[float]] = {}
            for n in args.agents:
                for rep in range(args.repeats):
                    for backend in BACKENDS:
                        endpoint = etcd.endpoint() if backend.endswith("etcd") else f"127.0.0.1:{free_port()}"
                        run_id = f"bench-{backend}-{n}-{rep}"
                        t = _measure(backend, endpoint, run_id, n, args.procs)
                        times.setdefault((backend, n), []).append(t)
                        print(f"  {backend:17s} agents={n:2d} rep={rep}: {t:6.2f} s", file=sys.stderr, flush=True)
        finally:
            etcd.stop()

    print(f"\nrendezvous time (median of {args.repeats}; go -> last agent joined), {args.procs} processes")
    print(f"{'agents':>6} | " + " | ".join(f"{b:>17}" for b in BACKENDS) + " | ez-c10d/c10d | ez-etcd/c10d")
    for n in args.agents:
        med = {b: statistics.median(times[(b, n)]) for b in BACKENDS}
        ratios = [med["elasticzero-c10d"] / med["torch-c10d"], med["elasticzero-etcd"] / med["torch-c10d"]]
        print(
            f"{n:>6} | "
            + " | ".join(f"{med[b]:>15.2f} s" for b in BACKENDS)
            + f" | {ratios[0]:>12.2f} | {ratios[1]:>12.2f}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        sys.exit(0)
    sys.exit(main())
