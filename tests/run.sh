#!/usr/bin/env bash
# The full test suite, from a fresh clone, as root: installs everything (apt + a venv with torch==2.13.0 CPU),
# brings up the real-part test bed (namespace hosts with sshd, pdsh, OpenMPI, MPICH, Slurm; etcd servers are
# started by the tests), runs ruff and the unit tests, then two streams side by side: the main one runs the
# integration tests that use the test bed, the agents' peers or a bound of wall time one at a time; the side one, in a
# cpu cgroup of low weight, runs mypy, then the other integration tests (SIDE below) and beside them the numerical tests
# again under every other CPU kernel set torch supports here (ATEN_CPU_CAPABILITY), then unit tests and a smoke on
# every other supported torch version (tests/torch_range.sh); and tears the test bed down again.
#   bash tests/run.sh [pytest args…]          (pytest args replace the main run's default: the unit tests on 2
#                                              xdist workers, then the integration tests; EZ_KEEP_TESTBED=1 leaves
#                                              the test bed up; EZ_SKIP_TORCH_RANGE=1 skips the torch versions other
#                                              than the pinned one)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
VENV=${EZ_VENV:-$REPO/.venv}
[ "$(id -u)" = 0 ] || { echo "tests/run.sh: run as root (it installs packages and creates network namespaces)" >&2; exit 1; }

# at exit: stop the torch range's installs and the side stream if still running (a run that failed early), remove
# the side stream's cgroup, tear the test bed down
finish() {
  [ -n "${prepare_pid:-}" ] && kill -- "-$prepare_pid" 2>/dev/null
  [ -n "${side_cg:-}" ] && remove_cgroup "$side_cg"
  [ -n "${EZ_KEEP_TESTBED:-}" ] || bash "$REPO/tests/cluster/down.sh" >/dev/null 2>&1 || true
}
trap finish EXIT

# Every test process computes on one thread (torch's intra-op pool, OpenMP): the tests' tensors are small, and on 2
# cores shared by a dozen processes the pool's spinning threads burned a third of the CPU (tests/unit/live + engine:
# 72 s of CPU on 2 threads, 48 s on 1). Exported, it reaches the agents' workers (torchrun's rule sets it only for
# nproc > 1) and the namespace hosts' (the launcher exports OMP_NUM_THREADS by default).
export OMP_NUM_THREADS=1
# Every Python process writes the bytecode of what it imports (pip installs with --no-compile, see
# tests/torch_range.sh), so the next process start reads it. A caller's PYTHONDONTWRITEBYTECODE=1 (this machine's
# shell sets it) made each of the suite's thousands of process starts compile again the ~650 of the 1,700 modules a
# worker imports that no earlier process had written: `import torch, torch.distributed.run` 5.3 s of CPU against 2.3 s
# from the caches; a fresh-clone run of this script 75 min before, 44 after (the integration tests 3447 s -> 1965 s).
unset PYTHONDONTWRITEBYTECODE

t0=$(date +%s)
command -v python3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3 python3-venv; }
# the test bed's Debian packages (apt: the network and dpkg) install beside the venv (pip), not before it
packages_log=$(mktemp /tmp/elasticzero-packages.XXXXXX)
bash tests/cluster/packages.sh >"$packages_log" 2>&1 &
packages_pid=$!
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned here (the local CPU build); the package itself declares a range. --no-compile: see tests/torch_range.sh
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "torch==2.13.0" -e ".[etcd,test]"
prc=0
wait "$packages_pid" || prc=$?
cat "$packages_log" && rm -f "$packages_log"
[ "$prc" = 0 ] || { echo "tests/run.sh: tests/cluster/packages.sh failed (exit $prc)" >&2; exit "$prc"; }
t1=$(date +%s)
bash tests/cluster/up.sh
t2=$(date +%s)
echo "tests/run.sh: install $((t1 - t0))s, test bed $((t2 - t1))s"

"$VENV/bin/ruff" check src plugins tests bench examples
"$VENV/bin/ruff" format --check src plugins tests bench examples

# The numerical tests (engine, checkpoint incl. the DeepSpeed import, HF models): they must hold on any x86-64 CPU,
# so they run again under every other kernel set torch can pick on this one (ATEN_CPU_CAPABILITY; torch falls back
# silently to its best one for a value this CPU lacks, so a capability counts only if torch reports it back, and
# tests/conftest.py stops a run whose requested capability torch does not use).
NUMERICAL_UNIT=(
  tests/unit/engine tests/unit/live/test_copies.py tests/unit/live/test_wire.py tests/unit/config/test_config_build.py
  tests/unit/config/test_config_activation_checkpointing.py
)
NUMERICAL=(
  tests/integration/engine/test_zero_equality.py tests/integration/engine/test_loss_scaler.py
  tests/integration/engine/test_ring.py tests/integration/checkpoint/test_ckpt_reshard.py
  tests/integration/checkpoint/test_ckpt_deepspeed_import.py tests/integration/hf/test_hf_models.py
  tests/integration/hf/test_hf_checkpointing.py
)
# ... less the ZeRO equality's 3-rank run: it was 2/3 of a rerun's CPU (world3 86 s, world2 28 s of a 241 s rerun under
# `default`: three ranks on two cores, every collective waits for a descheduled peer), and what a kernel set changes —
# the rounding of the same fp32 math, measured against float64 in the same run (ez_numerics) — its 2-rank run
# exercises on the same model, the same scenarios and the same bound (its odd sizes shard unevenly at 2 ranks too);
# the 3-rank layout is checked by the main run. Likewise the ring collectives' 3-rank run (9 s of a rerun): the ring
# adds in another order than gloo only across ranks, and its 2-rank run takes the same kernels
NUMERICAL_DESELECT="not world3"
# torch reports back an ATEN_CPU_CAPABILITY this CPU lacks on some CPUs (avx512 on an AVX2-only EPYC, then SIGILL in the
# first vectorised kernel): a capability counts only if the CPU has its instructions (the flags torch's own check asks
# for) and a vectorised kernel runs under it
cpu_has() { local f; for f in "$@"; do grep -qw "$f" /proc/cpuinfo || return 1; done; }
capability_flags() { case $1 in avx2) cpu_has avx2 fma ;; avx512) cpu_has avx512f avx512bw avx512dq avx512vl fma ;; *) true ;; esac; }
capability() {
  capability_flags "$1" || return 0
  ATEN_CPU_CAPABILITY=$1 "$VENV/bin/python" -c 'import torch; (torch.ones(4099) * 2).sum().item(); print(torch.backends.cpu.get_cpu_capability().lower())' 2>/dev/null
}
# start_prepare [CGROUP]: the torch range's installs, bound by the network and the disk, in the background from now
# on at the lowest priority — their own session is their own scheduler autogroup, which tests/torch_range.sh sets to
# nice 19 — or in CGROUP (the side stream's: its unpacking then takes from the side stream's share, not the main
# one's; an autogroup counts only in the root cgroup). Started after the unit tests: the CPU they leave is not what
# slows the tests beside them, the disk is (~3 GB of wheels a version written while the unit tests' two workers read
# the tree and its imports: 172 s against 81 s alone), and the integration tests leave it the time to finish in
start_prepare() {
  [ -n "${EZ_SKIP_TORCH_RANGE:-}" ] && return 0
  prepare_log=$(mktemp /tmp/elasticzero-torch-prepare.XXXXXX)
  prepared=$(mktemp -d /tmp/elasticzero-torch-prepared.XXXXXX)  # the versions it installed (torch_range.sh --prepared)
  # its own process group (setsid in place: a background job is no group leader): stopped whole at exit
  (
    [ -z "${1:-}" ] || echo "$BASHPID" >"$1/cgroup.procs"
    exec setsid bash tests/torch_range.sh --prepare --prepared "$prepared"
  ) >"$prepare_log" 2>&1 &
  prepare_pid=$!
}

# shellcheck source=tests/cpu_times.sh
source "$REPO/tests/cpu_times.sh"  # children_cpu
# busy_cpu → the machine's busy CPU seconds since boot (/proc/stat: user, nice, system, irq, softirq)
busy_cpu() { awk -v hz="$(getconf CLK_TCK)" '/^cpu / { printf "%d", ($2 + $3 + $4 + $7 + $8) / hz }' /proc/stat; }

# pytest exit 5 = no tests collected: that is a broken suite, not a pass
pytest_rc() { local rc=$1; [ "$rc" = 5 ] && { echo "tests/run.sh: pytest collected no tests" >&2; rc=1; }; return "$rc"; }

# numerical_reruns → 0 when the numerical tests pass under every other CPU kernel set this CPU has
numerical_reruns() {
  local main cap t crc rc=0
  main=$(capability "${ATEN_CPU_CAPABILITY:-}")  # the kernels the main run used
  for cap in default avx2 avx512; do
    [ "$cap" = "$main" ] && { echo "tests/run.sh: ATEN_CPU_CAPABILITY=$cap: the main run's kernels"; continue; }
    [ "$(capability "$cap")" = "$cap" ] || { echo "tests/run.sh: ATEN_CPU_CAPABILITY=$cap: not on this CPU"; continue; }
    t=$(date +%s)
    # one session, no xdist: in the side stream the CPU is the bound, and two xdist workers collect the tree twice
    # (the unit suite: 59 s of CPU on two workers, 47 s on one); a --basetemp of its own beside the main stream (below)
    ATEN_CPU_CAPABILITY=$cap "$VENV/bin/python" -m pytest -q -p no:cacheprovider ${side_tmp:+--basetemp "$side_tmp/$cap"} \
      -k "$NUMERICAL_DESELECT" "${NUMERICAL_UNIT[@]}" "${NUMERICAL[@]}"
    pytest_rc $?
    crc=$?
    echo "tests/run.sh: numerical tests under ATEN_CPU_CAPABILITY=$cap: $([ "$crc" = 0 ] && echo passed || echo "FAILED (exit $crc)") in $(($(date +%s) - t))s"
    [ "$rc" = 0 ] && rc=$crc
  done
  return "$rc"
}

# torch_range_stage → 0 when the unit tests and the smoke pass on every other supported torch (each from a venv cached
# outside the clone)
torch_range_stage() {
  local t trc
  [ -n "${EZ_SKIP_TORCH_RANGE:-}" ] && return 0
  t=$(date +%s)
  # the installs started after the unit tests, still running for the last versions maybe: each version's check waits
  # for its own (a failed install is no failure here: the check installs what is missing itself)
  bash tests/torch_range.sh ${prepared:+--prepared "$prepared"} ${prepare_pid:+--prepare-pid "$prepare_pid"}
  trc=$?
  grep '^tests/torch_range.sh' "$prepare_log"
  echo "tests/run.sh: torch range: $([ "$trc" = 0 ] && echo passed || echo "FAILED (exit $trc)") in $(($(date +%s) - t))s"
  return "$trc"
}

# The integration tests that run beside the others (the side stream, below): they use no test-bed host and no
# timing — spawned gloo ranks, the numerical files, the front doors' one-node jobs, the GPU check's sections (one
# process at a time) — so a slower CPU share only makes them slower. Every other integration test (the test bed's,
# the agents' peers and liveness, the clock tests) stays in the main stream, one at a time.
SIDE=(
  tests/integration/engine tests/integration/hf/test_hf_models.py tests/integration/hf/test_hf_checkpointing.py
  tests/integration/hf/test_hf_door.py tests/integration/checkpoint/test_ckpt_reshard.py
  tests/integration/checkpoint/test_ckpt_deepspeed_import.py tests/integration/checkpoint/test_ckpt_scheduler.py
  tests/integration/checkpoint/test_ckpt_faults.py tests/integration/config tests/integration/bench
  tests/integration/integrations tests/integration/lightning tests/integration/live/test_copies_overlap.py
  tests/integration/live/test_live_reshard.py tests/integration/data
)
# A fresh-clone run (2 cores, the torch range installed from the registry in the same run): 42.8 min one stream after
# the other, 31.3 min side by side — the main stream 1371 s, the side stream 1700 s (side tests 884, numerical reruns
# 361, torch range 361), the machine's 2 cores ~97% busy throughout: the suite is bound by its CPU (process starts,
# ~1.5-2.5 s of it each for torch's import), not by its waits. On a faster 2-core machine (session 21: an AVX-512
# Xeon at 2.6 GHz) 20.2 min: the streams 1076 s and 1985 s of CPU (92% of both cores) — the side stream 972 (its
# tests 519 s, each numerical rerun ~160 s, the range 181 s), the torch installs 251, the main stream the rest (~760;
# alone it is wait-bound: 993 s, 844 s of CPU).
# SIDE_SHARES: the side stream's cpu.shares (cgroup v1; the main stream's processes have 1024 each): where both want
# the CPU the main stream gets ~90% of it (its bounds were sized alone on the machine; busy loops: two main ones 10.3
# and 10.6 M iterations, the side one 2.3 M), and the side stream takes what the main one leaves idle — 0.8 of the 2
# cores on average (its processes mostly wait on their subprocesses)
SIDE_SHARES=128

# side_cgroup → the directory of a new cpu cgroup for the side stream (printed), or nothing where this machine has no
# writable cgroup-v1 cpu controller (or a v2 one with the cpu controller on at its root); cpu.weight is v2's shares/10
side_cgroup() {
  local v1=/sys/fs/cgroup/cpu v2=/sys/fs/cgroup dir
  if [ -f "$v1/cpu.shares" ]; then
    dir=$v1/elasticzero-ci-$$
    mkdir "$dir" 2>/dev/null && echo "$SIDE_SHARES" >"$dir/cpu.shares" 2>/dev/null && echo "$dir"
  elif grep -qw cpu "$v2/cgroup.subtree_control" 2>/dev/null; then
    dir=$v2/elasticzero-ci-$$
    mkdir "$dir" 2>/dev/null && echo $((SIDE_SHARES * 100 / 1024)) >"$dir/cpu.weight" 2>/dev/null && echo "$dir"
  fi
}

# remove_cgroup DIR: kill what is left in it, then remove it
remove_cgroup() {
  local pids
  pids=$(cat "$1/cgroup.procs" 2>/dev/null)
  # shellcheck disable=SC2086  # one pid a word
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$1" 2>/dev/null && return 0; sleep 0.5; done
}

# mypy_src → mypy's verdict on src/. Its cache lives outside the clone, beside the torch range's venvs (a clone's own
# would start empty every run): 58 s of CPU without it, 8 s from the cache of an earlier run in another clone and venv
# (mypy re-checks a module whose file's hash changed and takes a moved file of the same hash as it is)
mypy_src() { "$VENV/bin/mypy" --cache-dir "${EZ_TORCH_CACHE:-/var/cache/elasticzero-ci}/mypy" src; }

# side_tests → 0 when the side integration tests pass
side_tests() {
  local t irc
  t=$(date +%s)
  # a --basetemp of its own: two pytest sessions numbering and pruning /tmp/pytest-of-root at once is a race
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$side_tmp/side" --durations=10 "${SIDE[@]}"
  pytest_rc $?
  irc=$?
  echo "tests/run.sh: side integration tests: $([ "$irc" = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t))s"
  return "$irc"
}

# side_stream → 0 when the side integration tests, the numerical reruns and the torch range all pass. The reruns and
# then the torch range run beside the side tests (their output after the side tests'): the side stream's processes
# mostly wait on their subprocesses, and one after the other they left CPU idle that the cgroup's low weight would
# have let them take — in a fresh-clone run of session 26 the streams kept the 2 cores 88 % busy, the side stream
# ending 233 s after the main one (side tests 943 s, reruns 364 s, range 189 s, in a row). Nothing of either times
# itself (see SIDE): sharing the side stream's CPU only makes them slower.
side_stream() {
  local t0 rc=0 beside_log beside_pid
  t0=$(date +%s)
  mypy_src || rc=1
  beside_log=$(mktemp /tmp/elasticzero-beside.XXXXXX)
  ( brc=0; numerical_reruns || brc=1; torch_range_stage || brc=1; exit "$brc" ) >"$beside_log" 2>&1 &
  beside_pid=$!
  side_tests || rc=1
  wait "$beside_pid" || rc=1
  cat "$beside_log" && rm -f "$beside_log"
  children_cpu
  echo "tests/run.sh: side stream (mypy, side integration tests, numerical reruns, torch range):" \
    "$([ "$rc" = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t0))s, ${children_cpu_s}s of CPU"
  return "$rc"
}

set +e
if [ $# -gt 0 ]; then
  mypy_src
  rc=$?
  start_prepare
  "$VENV/bin/python" -m pytest -q "$@"
  pytest_rc $?
  prc=$?
  [ "$rc" = 0 ] && rc=$prc
  numerical_reruns || { [ "$rc" = 0 ] && rc=1; }
  torch_range_stage || { [ "$rc" = 0 ] && rc=1; }
else
  # the unit tests are independent: two xdist workers, one per core (one collection of the tree each; the one that
  # starts a second torch process shares its worker's core for a few seconds)
  t=$(date +%s)
  "$VENV/bin/python" -m pytest -q -n 2 tests/unit
  pytest_rc $?
  rc=$?
  echo "tests/run.sh: unit tests: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t))s"
  # The side stream in a cpu cgroup of its own, from now on beside the main one (its log printed after it)
  side_cg=$(side_cgroup)
  start_prepare "$side_cg"
  side_log=$(mktemp /tmp/elasticzero-side.XXXXXX)
  side_tmp=$(mktemp -d /tmp/elasticzero-side-tmp.XXXXXX)
  if [ -n "$side_cg" ]; then
    (
      echo "$BASHPID" >"$side_cg/cgroup.procs" || { echo "tests/run.sh: could not join the cgroup $side_cg"; exit 1; }
      side_stream
    ) >"$side_log" 2>&1 &
    side_pid=$!
    echo "tests/run.sh: the side stream runs beside the main one (cpu cgroup $side_cg, shares $SIDE_SHARES)"
  else
    echo "tests/run.sh: no writable cpu cgroup here: the side stream runs after the main one"
  fi
  # The main stream: the other integration tests one at a time. Run side by side with each other (session 15: three
  # xdist workers beside a second pytest) the load (8-10 on 2 cores) stretched every test's processes 3-5x and three
  # of four CI runs failed 3-9 tests each, each a bound met alone: their waits, timeouts and wall-clock bounds are
  # sized for one test's processes.
  t=$(date +%s) busy=$(busy_cpu)
  streams=$t
  ignore=()
  for path in "${SIDE[@]}"; do ignore+=(--ignore "$path"); done
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 "${ignore[@]}" tests/integration
  pytest_rc $?
  irc=$?
  echo "tests/run.sh: integration tests: $([ "$irc" = 0 ] && echo passed || echo "FAILED (exit $irc)") in $(($(date +%s) - t))s"
  [ "$rc" = 0 ] && rc=$irc
  t=$(date +%s)
  if [ -n "$side_cg" ]; then
    wait "$side_pid"
  else
    side_stream >"$side_log" 2>&1
  fi
  src=$?
  echo "tests/run.sh: the side stream ended $(($(date +%s) - t))s after the main one; its output:"
  cat "$side_log"
  # what the streams cost: the machine's CPU from the main stream's start to the side stream's end (the side stream's
  # and the torch installs' own in their lines above; the rest is the main stream's, its test-bed hosts' included)
  echo "tests/run.sh: the two streams: $(($(date +%s) - streams))s on $(getconf _NPROCESSORS_ONLN) cores, $(($(busy_cpu) - busy))s of CPU"
  [ "$rc" = 0 ] && [ "$src" != 0 ] && rc=1
  rm -rf "$side_log" "$side_tmp"
fi
rm -rf "${prepare_log:-}" "${prepared:-}"
prepare_pid=
set -e
exit "$rc"
