#!/usr/bin/env bash
# N fake hosts on this machine: each a network namespace + UTS namespace (own hostname) + its own sshd,
# on a private bridge. Idempotent: healthy parts are left alone, missing parts (re)started.
#   bash tests/cluster/hosts_up.sh [N=3]
# Result: bridge ezbr0 = 10.200.0.1/24 named "ezhead"; host node<i> = netns ezn<i>, 10.200.0.(10+i);
# marked blocks in /etc/hosts and /root/.ssh/config; `ssh node1 hostname` prints node1.
# Only addresses on this machine are used: the namespaces have no default route, so nothing leaves it
# (and torch's reverse lookups of ::ffff:10.200.0.x fail at once instead of waiting 10 s on DNS).
set -euo pipefail
N=${1:-3}
NET=10.200.0
BR=ezbr0
KEY=/root/.ssh/ez_ed25519
CONF=/etc/elasticzero-testbed
mkdir -p /run/sshd /root/.ssh "$CONF"   # /run/sshd: sshd's privilege-separation dir
chmod 700 /root/.ssh
ssh-keygen -A >/dev/null
[ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N '' -f "$KEY" -C elasticzero-testbed
touch /root/.ssh/authorized_keys; chmod 600 /root/.ssh/authorized_keys
grep -qF "$(cut -d' ' -f2 "$KEY.pub")" /root/.ssh/authorized_keys || cat "$KEY.pub" >> /root/.ssh/authorized_keys

touch /root/.ssh/config; chmod 600 /root/.ssh/config
sed -i '/^# >>> elasticzero-testbed >>>/,/^# <<< elasticzero-testbed <<</d' /root/.ssh/config
cat >> /root/.ssh/config <<CFG
# >>> elasticzero-testbed >>>
Host node* ezhead $NET.*
    User root
    IdentityFile $KEY
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
    ConnectTimeout 5
# <<< elasticzero-testbed <<<
CFG

cat > "$CONF/sshd_config" <<CFG
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
HostKey /etc/ssh/ssh_host_rsa_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM yes
AcceptEnv LANG LC_*
# pdsh / mpirun fan out many connections at once
MaxStartups 200:30:400
MaxSessions 200
UseDNS no
PrintMotd no
CFG

ip link show $BR >/dev/null 2>&1 || ip link add $BR type bridge
ip addr replace $NET.1/24 dev $BR   # replace: idempotent, no check-then-add race
ip link set $BR up

tmp=$(mktemp)
sed '/# >>> elasticzero-testbed >>>/,/# <<< elasticzero-testbed <<</d' /etc/hosts > "$tmp"
{ echo "# >>> elasticzero-testbed >>>"; echo "$NET.1 ezhead"
  for i in $(seq 1 "$N"); do echo "$NET.$((10 + i)) node$i"; done
  echo "# <<< elasticzero-testbed <<<"; } >> "$tmp"
cat "$tmp" > /etc/hosts; rm -f "$tmp"   # keep the inode: /etc/hosts may be bind-mounted

for i in $(seq 1 "$N"); do
  ns=ezn$i; veth=ezv$i; addr=$NET.$((10 + i)); pidf=/run/elasticzero-testbed/sshd-node$i.pid
  mkdir -p /run/elasticzero-testbed
  ip netns list | grep -qw "^$ns" || ip netns add $ns
  if ! ip link show $veth >/dev/null 2>&1; then
    ip link add $veth type veth peer name eth0 netns $ns
    ip link set $veth master $BR up
  fi
  ip -n $ns link set lo up
  ip -n $ns addr replace $addr/24 dev eth0
  ip -n $ns link set eth0 up
  ip -n $ns route del default 2>/dev/null || true
  if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then continue; fi
  ip netns exec $ns unshare --uts sh -c \
    "hostname node$i && exec /usr/sbin/sshd -f $CONF/sshd_config -o ListenAddress=$addr -o PidFile=$pidf"
done

for i in $(seq 1 "$N"); do
  for _ in $(seq 1 100); do ssh -o ConnectTimeout=1 node$i true 2>/dev/null && break; sleep 0.1; done
  [ "$(ssh node$i hostname)" = "node$i" ] || { echo "hosts_up.sh: node$i not reachable over ssh" >&2; exit 1; }
done
echo "hosts_up.sh: node1..node$N up"
