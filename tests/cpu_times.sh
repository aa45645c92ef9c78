# Sourced by tests/run.sh and tests/torch_range.sh.
# children_cpu: sets children_cpu_s to the CPU seconds (user + system) of this shell's finished children and all they
# waited for: bash's `times` (its second line), run in this shell — never call it in a pipeline or a command
# substitution, whose forked subshell starts with no children's time
children_cpu() {
  local f
  f=$(mktemp) && times >"$f"
  children_cpu_s=$(awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/);
    printf "%d", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$f")
  rm -f "$f"
}
