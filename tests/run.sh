#!/usr/bin/env bash
# The full test suite, from a fresh clone, as root: installs everything (apt + a venv with torch==2.13.0 CPU),
# brings up the real-part test bed (namespace hosts with sshd, pdsh, OpenMPI, MPICH, Slurm; etcd servers are
# started by the tests), runs ruff and pytest, and tears the test bed down again.
#   bash tests/run.sh [pytest args…]          (EZ_KEEP_TESTBED=1 leaves the test bed up)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
VENV=${EZ_VENV:-$REPO/.venv}
[ "$(id -u)" = 0 ] || { echo "tests/run.sh: run as root (it installs packages and creates network namespaces)" >&2; exit 1; }

t0=$(date +%s)
bash tests/cluster/packages.sh
command -v python3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3 python3-venv; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned here (the local CPU build); the package itself declares a range
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[etcd,test]"
t1=$(date +%s)

if [ -z "${EZ_KEEP_TESTBED:-}" ]; then trap 'bash "$REPO/tests/cluster/down.sh" >/dev/null 2>&1 || true' EXIT; fi
bash tests/cluster/up.sh
t2=$(date +%s)
echo "tests/run.sh: install $((t1 - t0))s, test bed $((t2 - t1))s"

"$VENV/bin/ruff" check src plugins tests bench examples
"$VENV/bin/ruff" format --check src plugins tests bench examples
"$VENV/bin/mypy" src

set +e
"$VENV/bin/python" -m pytest -q "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected: that is a broken suite, not a pass
[ "$rc" = 5 ] && { echo "tests/run.sh: pytest collected no tests" >&2; exit 1; }
exit "$rc"
