#!/usr/bin/env bash
# The test suite, run again and again under CPU load from stress-ng (Debian package stress-ng):
# the check that its timing windows hold on a loaded machine. Stops at the first failing run.
#   bench/stress_suite.sh [RUNS] [HOGS] [pytest args...]
# RUNS (default 10) runs, HOGS (default: the core count) busy-looping stress-ng workers beside
# it; pytest args default to the whole default suite. Logs go to out/stress/run-N.log.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
hogs=${2:-$(nproc)}
shift $(( $# > 2 ? 2 : $# ))
command -v stress-ng >/dev/null || { echo "stress-ng not found (apt-get install stress-ng)" >&2; exit 2; }
mkdir -p out/stress
stress-ng --cpu "$hogs" --cpu-method loop --quiet &
hog=$!
trap 'kill $hog 2>/dev/null || true' EXIT
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -p no:cacheprovider "$@" >"out/stress/run-$i.log" 2>&1; then
    echo "run $i of $runs: passed in $(( $(date +%s) - start )) s ($(tail -1 "out/stress/run-$i.log"))"
  else
    echo "run $i of $runs: FAILED after $(( $(date +%s) - start )) s, see out/stress/run-$i.log"
    grep -E "^(FAILED|ERROR)" "out/stress/run-$i.log" || true
    exit 1
  fi
done
echo "all $runs runs passed under $hogs stress-ng cpu hogs (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
