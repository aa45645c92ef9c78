#!/usr/bin/env bash
# The torch-range stage of tests/run.sh: every supported torch minor other than the pinned one (the whole suite runs on
# that) gets unit tests (the private-name canaries always), and the ends of the range the smoke too
# (tests/integration/elastic/test_example_smoke.py: a 2-rank elasticzero-launch of examples/train_gpt.py that
# checkpoints, resumed on 1 rank at another ZeRO stage). Each version has a venv cached at $EZ_TORCH_CACHE/torch-MAJOR.MINOR, outside the clone, reused
# while it holds exactly that torch; elasticzero itself is installed into it again each run (not editable: the
# package as pip builds it). One line per version; exit 1 if any version failed (its log path is in its line).
#
# Which unit tests where: the ends of the range (the oldest and the newest version) run the whole unit suite; the
# versions between them run the canaries (every private torch name, each torchcompat decision against the version it
# is documented for) and the unit tests of the modules built on torch's private elastic-agent and rendezvous names
# (UNIT_BETWEEN below). What can differ across versions is what the canaries pin; a public behaviour that changed
# between the two ends and changed back is not a case worth a full unit run per minor, and a difference that holds
# on from some version on shows at the newest. The smoke (the real launcher, agent, engine and checkpoint on that
# torch) runs at the ends by the same rule: between them, what it would add over the canaries is a public behaviour
# of one minor alone (and its ~30 s per version counted against the CI's time, issue 29).
#
# Installing the registry's builds (~3 GB of wheels a version with CUDA's libraries, unpacked to more) is bound by the
# network and the disk, not the CPU: tests/run.sh starts `torch_range.sh --prepare` in the background after the unit
# tests, which installs torch into each version's venv that is not cached yet, at the lowest CPU priority (its
# autogroup at nice 19, below; `ionice -c 3` counts only under the bfq and cfq disk schedulers), overlapping the
# integration tests (mostly waiting on their subprocesses); each version's check waits for that version's install,
# and installs itself what the prepare did not. The prepare installs the test extra's packages too (transformers, accelerate,
# lightning, ...), so a version's check pays only for building elasticzero.
#   bash tests/torch_range.sh [--prepared DIR [--prepare-pid PID]] [VERSION…]   (default: TORCH_VERSIONS below)
#   bash tests/torch_range.sh --prepare [--prepared DIR] [VERSION…]             (the venvs and their torch only)
# --prepared DIR: the prepare notes there each version it installed (torch, the test extra and elasticzero from this
# tree) and each it tried, and the check installs only a version not noted (tests/run.sh gives both the same fresh
# DIR: the tree does not change during its run; ~30 s of pip a version). --prepare-pid PID: the prepare still runs as
# PID; each version's check first waits until the prepare has tried that version (or ended), so the first versions
# are checked while the last one still installs (on a 2-core machine with a slower disk the stage waited 50-80 s for
# all four).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
TORCH_VERSIONS=(2.11.0 2.12.1 2.14.1 2.15.0)
UNIT_BETWEEN=(tests/unit/test_torch_canaries.py tests/unit/agent tests/unit/rendezvous)
CACHE=${EZ_TORCH_CACHE:-/var/cache/elasticzero-ci}
SMOKE=tests/integration/elastic/test_example_smoke.py
# shellcheck source=tests/cpu_times.sh
source "$REPO/tests/cpu_times.sh"  # children_cpu
# this machine's pip constraints cap torch below the newest release; the versions here are pinned one by one instead
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
# each version's processes write their bytecode caches (tests/run.sh: why)
unset PYTHONDONTWRITEBYTECODE

# cached VERSION → 0 when VERSION's venv holds exactly that torch
cached() {
  local have
  have=$("$CACHE/torch-${1%.*}/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
  [ "$have" = "$1" ]
}

# venv VERSION → its directory, holding torch==VERSION (created or replaced when it holds another torch)
venv() {
  local v=$1 dir="$CACHE/torch-${1%.*}"
  if ! cached "$v"; then
    rm -rf "$dir" && mkdir -p "$CACHE" && python3 -m venv "$dir" || return 1
  fi
  echo "$dir"
}

# pip_install DIR VERSION [PREFIX…] → 0 when pip installed torch==VERSION and this tree's package with the test
# extra into the venv DIR (under the command PREFIX, if given). pip builds in the tree: `build/` is removed first, so
# no stale build/lib of an earlier tree enters the wheel (the prepare's install is the one a --prepared check keeps).
# --no-compile (here and in tests/run.sh): pip's byte-compilation of every installed module cost 44 s of CPU for torch
# alone (16 s without); the modules a run imports are compiled on their first import instead (tests/run.sh unsets
# PYTHONDONTWRITEBYTECODE, and so does this script). --no-cache-dir: the wheels (~3 GB a version) are not written a
# second time into pip's cache, which a fresh machine never reads again (the venv is the cache)
pip_install() {
  local dir=$1 v=$2
  shift 2
  rm -rf build
  "$@" "$dir/bin/python" -m pip install -q --no-compile --no-cache-dir "torch==$v" ".[test]"
}

# prepare VERSION → 0 when VERSION's venv holds torch==VERSION, the test extra's packages and elasticzero (installed
# now, at the lowest CPU and I/O priority): a check given --prepared then installs nothing for it
prepare() {
  local v=$1 dir
  dir=$(venv "$v") || return 1
  pip_install "$dir" "$v" nice -n 19 ionice -c 3
}

# check VERSION LOG UNIT… → 0 when the install (unless the prepare made it), the unit tests UNIT… and (at the
# ends) the smoke pass; their outcome on stdout
check() {
  local v=$1 log=$2 dir
  shift 2
  dir=$(venv "$v") || { echo "venv failed"; return 1; }
  if [ -z "$PREPARED" ] || [ ! -e "$PREPARED/$v" ]; then
    # pip builds in the tree (pip_install): never beside the prepare's own build of a later version
    while [ -n "$PREPARE_PID" ] && kill -0 "$PREPARE_PID" 2>/dev/null; do sleep 1; done
    pip_install "$dir" "$v" >>"$log" 2>&1 || { echo "install failed"; return 1; }
  fi
  # as in the main run: the unit tests on two xdist workers; each session a --basetemp of its own (tests/run.sh may
  # still run its main stream's pytest, and two sessions numbering and pruning /tmp/pytest-of-root at once race)
  "$dir/bin/python" -m pytest -q -p no:cacheprovider -n 2 --basetemp "$log.unit" "$@" >>"$log" 2>&1
  local unit=$?
  is_end "$v" || { echo "unit $(summary "$log" 1)"; return "$unit"; }
  "$dir/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$log.smoke" "$SMOKE" >>"$log" 2>&1
  local smoke=$?
  echo "unit $(summary "$log" 1), smoke $(summary "$log" 2)"
  [ "$unit" = 0 ] && [ "$smoke" = 0 ]
}

# summary LOG N → pytest's Nth summary line in LOG ("3 failed, 1026 passed in 80.12s"), without its decoration
summary() { grep -E '^=*[ ]*[0-9]+ [a-z]+.* in [0-9.]+s' "$1" | sed -n "$2p" | tr -d '=' | sed 's/^ *//; s/ *$//'; }

# is_end VERSION → 0 when VERSION is the oldest or the newest of TORCH_VERSIONS
is_end() { [ "$1" = "${TORCH_VERSIONS[0]}" ] || [ "$1" = "${TORCH_VERSIONS[-1]}" ]; }

# unit_tests VERSION → the unit tests VERSION runs: all at the ends of TORCH_VERSIONS, UNIT_BETWEEN between them
unit_tests() {
  if is_end "$1"; then
    echo tests/unit
  else
    echo "${UNIT_BETWEEN[@]}"
  fi
}

mode=check PREPARED= PREPARE_PID=
[ "${1:-}" = --prepare ] && { mode=prepare; shift; }
[ "${1:-}" = --prepared ] && { PREPARED=${2:?--prepared DIR}; shift 2; }
[ "${1:-}" = --prepare-pid ] && { PREPARE_PID=${2:?--prepare-pid PID}; shift 2; }
versions=("$@")
[ $# -gt 0 ] || versions=("${TORCH_VERSIONS[@]}")
failed=0
if [ "$mode" = prepare ]; then
  # Started in its own session (tests/run.sh: setsid), the prepare is its own scheduler autogroup, and with autogroups
  # on (kernel.sched_autogroup_enabled) the CPU is split between autogroups before nice counts inside one: at nice 19
  # its unpacking took half the CPU beside the tests (the integration tests ~1.5x slower while it ran). The autogroup
  # itself is set to nice 19 — only when this process leads its session, so a prepare run from a terminal never
  # lowers the terminal's session.
  [ "$(ps -o sid= -p $$ | tr -d ' ')" = "$$" ] && { echo 19 >"/proc/$$/autogroup"; } 2>/dev/null
  for v in "${versions[@]}"; do
    t0=$(date +%s)
    if prepare "$v"; then verdict=ok; else verdict=FAILED; failed=1; fi
    [ "$verdict" = ok ] && [ -n "$PREPARED" ] && touch "$PREPARED/$v"
    [ -n "$PREPARED" ] && touch "$PREPARED/$v.tried"
    echo "tests/torch_range.sh --prepare: torch $v: $verdict; $(($(date +%s) - t0))s"
  done
  children_cpu  # the installs' CPU
  echo "tests/torch_range.sh --prepare: ${children_cpu_s}s of CPU"
  exit "$failed"
fi
LOGS=$(mktemp -d /tmp/elasticzero-torch-range.XXXXXX)
# await_prepare VERSION → the seconds waited until the prepare (--prepare-pid) tried VERSION or ended
await_prepare() {
  local t0=$SECONDS
  while [ -n "$PREPARE_PID" ] && [ ! -e "$PREPARED/$1.tried" ] && kill -0 "$PREPARE_PID" 2>/dev/null; do sleep 1; done
  echo $((SECONDS - t0))
}

for v in "${versions[@]}"; do
  waited=$(await_prepare "$v")
  t0=$(date +%s)
  log="$LOGS/torch-$v.log"
  # shellcheck disable=SC2046  # unit_tests prints words without spaces
  if outcome=$(check "$v" "$log" $(unit_tests "$v")); then verdict=ok; else verdict="FAILED (log: $log)"; failed=1; fi
  echo "tests/torch_range.sh: torch $v: $verdict: $outcome; $(($(date +%s) - t0))s (after ${waited}s for its install)"
done
[ "$failed" = 0 ] && rm -rf "$LOGS"
exit "$failed"
