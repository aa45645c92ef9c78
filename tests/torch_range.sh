#!/usr/bin/env bash
# The torch-range stage of tests/run.sh: every supported torch minor other than the pinned one (the whole suite runs on
# that) gets the unit suite (the private-name canaries included) and the smoke (tests/integration/elastic/
# test_example_smoke.py: a 2-rank elasticzero-launch of examples/train_gpt.py that checkpoints, resumed on 1 rank at
# another ZeRO stage). Each version has a venv cached at $EZ_TORCH_CACHE/torch-MAJOR.MINOR, outside the clone, reused
# while it holds exactly that torch; elasticzero itself is installed into it again each run (not editable: the
# package as pip builds it). One line per version; exit 1 if any version failed (its log path is in its line).
#   bash tests/torch_range.sh [VERSION…]     (default: TORCH_VERSIONS below)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
TORCH_VERSIONS=(2.11.0 2.12.1 2.14.1 2.15.0)
CACHE=${EZ_TORCH_CACHE:-/var/cache/elasticzero-ci}
LOGS=$(mktemp -d /tmp/elasticzero-torch-range.XXXXXX)
SMOKE=tests/integration/elastic/test_example_smoke.py
# this machine's pip constraints cap torch below the newest release; the versions here are pinned one by one instead
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

# venv VERSION → its directory, holding torch==VERSION (created or replaced when it holds another torch)
venv() {
  local v=$1 dir="$CACHE/torch-${1%.*}" have
  have=$("$dir/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
  if [ "$have" != "$v" ]; then
    rm -rf "$dir" && mkdir -p "$CACHE" && python3 -m venv "$dir" || return 1
  fi
  echo "$dir"
}

# check VERSION LOG → 0 when the install, the unit suite and the smoke pass; their outcome on stdout
check() {
  local v=$1 log=$2 dir
  dir=$(venv "$v") || { echo "venv failed"; return 1; }
  rm -rf build  # pip builds in the tree: no stale build/lib of an earlier version may enter the wheel
  "$dir/bin/python" -m pip install -q "torch==$v" ".[test]" >>"$log" 2>&1 || { echo "install failed"; return 1; }
  "$dir/bin/python" -m pytest -q -p no:cacheprovider tests/unit >>"$log" 2>&1
  local unit=$?
  "$dir/bin/python" -m pytest -q -p no:cacheprovider "$SMOKE" >>"$log" 2>&1
  local smoke=$?
  echo "unit $(summary "$log" 1), smoke $(summary "$log" 2)"
  [ "$unit" = 0 ] && [ "$smoke" = 0 ]
}

# summary LOG N → pytest's Nth summary line in LOG ("3 failed, 1026 passed in 80.12s"), without its decoration
summary() { grep -E '^=*[ ]*[0-9]+ [a-z]+.* in [0-9.]+s' "$1" | sed -n "$2p" | tr -d '=' | sed 's/^ *//; s/ *$//'; }

versions=("$@")
[ $# -gt 0 ] || versions=("${TORCH_VERSIONS[@]}")
failed=0
for v in "${versions[@]}"; do
  t0=$(date +%s)
  log="$LOGS/torch-$v.log"
  if outcome=$(check "$v" "$log"); then verdict=ok; else verdict="FAILED (log: $log)"; failed=1; fi
  echo "tests/torch_range.sh: torch $v: $verdict: $outcome; $(($(date +%s) - t0))s"
done
[ "$failed" = 0 ] && rm -rf "$LOGS"
exit "$failed"
