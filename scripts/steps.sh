# Timing of a script's steps, sourced by scripts/test.sh: `step NAME CMD...` runs CMD and prints
# how long it took; `step_done NAME` records the time since the last step for work done inline;
# `step_summary` prints every step's time and the total. A failing step still prints its time,
# then the script stops (set -e).
_steps_start=$(date +%s)
_steps_last=$_steps_start
_steps_names=()
_steps_secs=()

_steps_record() {  # NAME SECONDS
  _steps_names+=("$1")
  _steps_secs+=("$2")
}

step() {
  local name=$1
  shift
  echo "== step $name: $*"
  local t0
  t0=$(date +%s)
  local rc=0
  "$@" || rc=$?
  local secs=$(( $(date +%s) - t0 ))
  _steps_record "$name" "$secs"
  _steps_last=$(date +%s)
  if [ $rc -ne 0 ]; then
    echo "== step $name failed (exit $rc) after ${secs} s"
    step_summary
    return $rc
  fi
  echo "== step $name: ${secs} s"
}

step_done() {
  local now
  now=$(date +%s)
  _steps_record "$1" $(( now - _steps_last ))
  echo "== step $1: $(( now - _steps_last )) s"
  _steps_last=$now
}

step_summary() {
  echo "== step times (s):"
  local i
  for i in "${!_steps_names[@]}"; do
    printf '   %6d  %s\n' "${_steps_secs[$i]}" "${_steps_names[$i]}"
  done
  printf '   %6d  total\n' $(( $(date +%s) - _steps_start ))
}
