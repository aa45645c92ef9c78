#!/usr/bin/env bash
# Install the Debian packages the real-part tests need (idempotent; quick when already installed); g++ is Inductor's
# compiler (torch.compile on the CPU: tests/integration/engine/test_compile.py).
#   bash tests/cluster/packages.sh
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PKGS=(openssh-server openssh-client pdsh iproute2 util-linux procps openmpi-bin mpich slurm-wlm munge g++
      etcd-server etcd-client)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "packages.sh: installing ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# both MPIs are installed: tests call mpirun.openmpi / mpiexec.hydra by name, never the alternatives links
for b in sshd pdsh mpirun.openmpi mpiexec.hydra slurmctld slurmd munged srun etcd; do
  command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || { echo "packages.sh: $b missing after install" >&2; exit 1; }
done
