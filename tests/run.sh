#!/usr/bin/env bash
# The full test suite, from a fresh clone, as root: installs everything (apt + a venv with torch==2.13.0 CPU),
# brings up the real-part test bed (namespace hosts with sshd, pdsh, OpenMPI, MPICH, Slurm; etcd servers are
# started by the tests), runs ruff, mypy and the unit tests, then the integration tests one at a time, then the
# numerical tests again under every other CPU kernel set torch supports here
# (ATEN_CPU_CAPABILITY), then unit tests and a smoke on every other supported torch version (tests/torch_range.sh);
# and tears the test bed down again.
#   bash tests/run.sh [pytest args…]          (pytest args replace the main run's default: the unit tests on 2
#                                              xdist workers, then the integration tests; EZ_KEEP_TESTBED=1 leaves
#                                              the test bed up; EZ_SKIP_TORCH_RANGE=1 skips the torch versions other
#                                              than the pinned one)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
VENV=${EZ_VENV:-$REPO/.venv}
[ "$(id -u)" = 0 ] || { echo "tests/run.sh: run as root (it installs packages and creates network namespaces)" >&2; exit 1; }

# at exit: stop the torch range's installs if still running (a run that failed early), tear the test bed down
finish() {
  [ -n "${prepare_pid:-}" ] && kill -- "-$prepare_pid" 2>/dev/null
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
bash tests/cluster/packages.sh
command -v python3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3 python3-venv; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch is pinned here (the local CPU build); the package itself declares a range. --no-compile: see tests/torch_range.sh
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "torch==2.13.0" -e ".[etcd,test]"
t1=$(date +%s)
bash tests/cluster/up.sh
t2=$(date +%s)
echo "tests/run.sh: install $((t1 - t0))s, test bed $((t2 - t1))s"

"$VENV/bin/ruff" check src plugins tests bench examples
"$VENV/bin/ruff" format --check src plugins tests bench examples
"$VENV/bin/mypy" src

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
# torch reports back an ATEN_CPU_CAPABILITY this CPU lacks on some CPUs (avx512 on an AVX2-only EPYC, then SIGILL in the
# first vectorised kernel): a capability counts only if the CPU has its instructions (the flags torch's own check asks
# for) and a vectorised kernel runs under it
cpu_has() { local f; for f in "$@"; do grep -qw "$f" /proc/cpuinfo || return 1; done; }
capability_flags() { case $1 in avx2) cpu_has avx2 fma ;; avx512) cpu_has avx512f avx512bw avx512dq avx512vl fma ;; *) true ;; esac; }
capability() {
  capability_flags "$1" || return 0
  ATEN_CPU_CAPABILITY=$1 "$VENV/bin/python" -c 'import torch; (torch.ones(4099) * 2).sum().item(); print(torch.backends.cpu.get_cpu_capability().lower())' 2>/dev/null
}
# start_prepare: the torch range's installs, bound by the network and the disk, in the background from now on at the
# lowest priority — their own session is their own scheduler autogroup, which tests/torch_range.sh sets to nice 19.
# Started after the unit tests: the CPU they leave is not what slows the tests beside them, the disk is (~3 GB of
# wheels a version written while the unit tests' two workers read the tree and its imports: 172 s against 81 s
# alone), and the integration tests' ~35 min leave them the idle time to finish in
start_prepare() {
  [ -n "${EZ_SKIP_TORCH_RANGE:-}" ] && return 0
  prepare_log=$(mktemp /tmp/elasticzero-torch-prepare.XXXXXX)
  prepared=$(mktemp -d /tmp/elasticzero-torch-prepared.XXXXXX)  # the versions it installed (torch_range.sh --prepared)
  setsid bash tests/torch_range.sh --prepare --prepared "$prepared" >"$prepare_log" 2>&1 &  # its own process group: stopped whole at exit
  prepare_pid=$!
}

# pytest exit 5 = no tests collected: that is a broken suite, not a pass
pytest_rc() { local rc=$1; [ "$rc" = 5 ] && { echo "tests/run.sh: pytest collected no tests" >&2; rc=1; }; return "$rc"; }

# numerical_reruns → 0 when the numerical tests pass under every other CPU kernel set this CPU has
numerical_reruns() {
  local main cap t crc nrc rc=0
  main=$(capability "${ATEN_CPU_CAPABILITY:-}")  # the kernels the main run used
  for cap in default avx2 avx512; do
    [ "$cap" = "$main" ] && { echo "tests/run.sh: ATEN_CPU_CAPABILITY=$cap: the main run's kernels"; continue; }
    [ "$(capability "$cap")" = "$cap" ] || { echo "tests/run.sh: ATEN_CPU_CAPABILITY=$cap: not on this CPU"; continue; }
    t=$(date +%s)
    # the single-process ones on two xdist workers, as in the main run
    ATEN_CPU_CAPABILITY=$cap "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 "${NUMERICAL_UNIT[@]}"
    pytest_rc $?
    crc=$?
    ATEN_CPU_CAPABILITY=$cap "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${NUMERICAL[@]}"
    pytest_rc $?
    nrc=$?
    [ "$crc" = 0 ] && crc=$nrc
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
  # the installs started after the unit tests (a failed one is no failure here: the stage installs what is missing
  # itself); polled, as this may run in a subshell that cannot wait for its parent's child
  while [ -n "${prepare_pid:-}" ] && kill -0 "$prepare_pid" 2>/dev/null; do sleep 2; done
  grep '^tests/torch_range.sh' "$prepare_log"
  echo "tests/run.sh: torch range installs waited for: $(($(date +%s) - t))s"
  bash tests/torch_range.sh ${prepared:+--prepared "$prepared"}
  trc=$?
  echo "tests/run.sh: torch range: $([ "$trc" = 0 ] && echo passed || echo "FAILED (exit $trc)") in $(($(date +%s) - t))s"
  return "$trc"
}

set +e
if [ $# -gt 0 ]; then
  start_prepare
  "$VENV/bin/python" -m pytest -q "$@"
  pytest_rc $?
  rc=$?
else
  # the unit tests are independent: two xdist workers, one per core (one collection of the tree each; the one that
  # starts a second torch process shares its worker's core for a few seconds)
  t=$(date +%s)
  "$VENV/bin/python" -m pytest -q -n 2 tests/unit
  pytest_rc $?
  rc=$?
  echo "tests/run.sh: unit tests: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t))s"
  start_prepare
  # The integration tests one at a time. Run side by side (session 15: three xdist workers beside a second pytest),
  # the load (8-10 on 2 cores) stretched every test's processes 3-5x and three of four CI runs failed 3-9 tests
  # each, each a bound met alone: their waits, timeouts and wall-clock bounds are sized for one test's processes.
  t=$(date +%s)
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 tests/integration
  pytest_rc $?
  irc=$?
  echo "tests/run.sh: integration tests: $([ "$irc" = 0 ] && echo passed || echo "FAILED (exit $irc)") in $(($(date +%s) - t))s"
  [ "$rc" = 0 ] && rc=$irc
fi
numerical_reruns || { [ "$rc" = 0 ] && rc=1; }
torch_range_stage || { [ "$rc" = 0 ] && rc=1; }
rm -rf "${prepare_log:-}" "${prepared:-}"
prepare_pid=
set -e
exit "$rc"
