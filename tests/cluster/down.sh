#!/usr/bin/env bash
# Tear down what up.sh started: Slurm daemons, munged (only if we started it), the sshd hosts, namespaces,
# bridge, and the marked blocks in /etc/hosts and /root/.ssh/config. Kills only by our pid files and by
# `ip netns pids` of our own namespaces. Idempotent.
set -uo pipefail
RUN=/run/elasticzero-testbed
stop_pidfile() { [ -f "$1" ] && kill "$(cat "$1")" 2>/dev/null; rm -f "$1"; }
for f in "$RUN"/slurmd-*.pid "$RUN"/slurmctld.pid "$RUN"/munged.pid "$RUN"/sshd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
for ns in $(ip netns list 2>/dev/null | awk '/^ezn[0-9]+/{print $1}'); do
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  ip netns del "$ns" 2>/dev/null
done
for v in $(ip -o link show 2>/dev/null | awk -F': ' '$2 ~ /^ezv[0-9]+/{split($2,a,"@"); print a[1]}'); do
  ip link del "$v" 2>/dev/null
done
ip link del ezbr0 2>/dev/null
tmp=$(mktemp)
sed '/# >>> elasticzero-testbed >>>/,/# <<< elasticzero-testbed <<</d' /etc/hosts > "$tmp" && cat "$tmp" > /etc/hosts
rm -f "$tmp"
[ -f /root/.ssh/config ] && sed -i '/^# >>> elasticzero-testbed >>>/,/^# <<< elasticzero-testbed <<</d' /root/.ssh/config
rm -f "$RUN/testbed.json"
echo "down.sh: test bed stopped"
