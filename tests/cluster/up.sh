#!/usr/bin/env bash
# Bring up the whole real-part test bed, as root, from scratch or on top of a running one (idempotent):
# packages, 3 namespace hosts with sshd, a 2-node Slurm cluster. etcd servers are started by the tests
# themselves (tests/cluster/etcd_server.py), on free loopback ports. Writes the description the tests read:
# /run/elasticzero-testbed/testbed.json.  Tear down with tests/cluster/down.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
HOSTS=${EZ_TESTBED_HOSTS:-3}
SLURM_NODES=${EZ_TESTBED_SLURM_NODES:-2}
[ "$(id -u)" = 0 ] || { echo "up.sh: must run as root (namespaces, sshd, slurm)" >&2; exit 1; }
t0=$(date +%s.%N)
bash "$HERE/packages.sh"
t1=$(date +%s.%N)
bash "$HERE/hosts_up.sh" "$HOSTS"
t2=$(date +%s.%N)
bash "$HERE/slurm_up.sh" "$SLURM_NODES"
t3=$(date +%s.%N)
python3 - "$HOSTS" "$SLURM_NODES" <<'PY'
import json, os, sys
n, s = int(sys.argv[1]), int(sys.argv[2])
d = {
    "hosts": [f"node{i}" for i in range(1, n + 1)],
    "addrs": [f"10.200.0.{10 + i}" for i in range(1, n + 1)],
    "netns": [f"ezn{i}" for i in range(1, n + 1)],
    "head": "ezhead",
    "head_addr": "10.200.0.1",
    "slurm_nodes": [f"node{i}" for i in range(1, s + 1)],
}
os.makedirs("/run/elasticzero-testbed", exist_ok=True)
with open("/run/elasticzero-testbed/testbed.json", "w") as f:
    json.dump(d, f, indent=1)
PY
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" \
  'BEGIN{printf "up.sh: packages %.1fs, hosts %.1fs, slurm %.1fs\n", b-a, c-b, d-c}'
