#!/usr/bin/env bash
# `make test-under-load`: the integration tests with two CPU hogs beside them, as on a machine
# shared with other work. Every assertion is measured against the same run (the target's own CPU
# time, its own counters), so the suite passes here as on a quiet machine, only slower.
#
#   scripts/test-under-load.sh MAKE    (make's own $(MAKE), so that its flags carry over)
#
# Ends with one line: `test-under-load: passed=N failed=M minutes=X load=L`, L the mean
# one-minute load average sampled during the run.
set -euo pipefail
cd "$(dirname "$0")/.."
make_cmd=${1:-make}

if ! command -v stress-ng >/dev/null; then
  echo "test-under-load: installing stress-ng" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade stress-ng >/dev/null
fi

logs=target/test-logs
mkdir -p "$logs"
# nice 0, as other work on the machine would run: the hogs compete with the tests as equals.
stress-ng --cpu 2 --cpu-method all --quiet &
hogs=$!
sampler=''
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
  kill "$hogs" 2>/dev/null || true
  if [[ -n $sampler ]]; then kill "$sampler" 2>/dev/null || true; fi
  wait 2>/dev/null || true
}
trap cleanup EXIT
: >"$logs/load.txt"
(while sleep 30; do cut -d' ' -f1 /proc/loadavg >>"$logs/load.txt"; done) &
sampler=$!

started=$SECONDS
status=0
"$make_cmd" --no-print-directory integration-test || status=$?
minutes=$(((SECONDS - started) / 60))

passed=$(grep -o '^test result: .*' "$logs/integration.log" | grep -o '[0-9]* passed' | awk '{s += $1} END {print s + 0}')
failed=$(grep -o '^test result: .*' "$logs/integration.log" | grep -o '[0-9]* failed' | awk '{s += $1} END {print s + 0}')
load=$(awk '{s += $1; n++} END {if (n) printf "%.1f", s / n; else print "?"}' "$logs/load.txt")
echo "test-under-load: passed=$passed failed=$failed minutes=$minutes load=$load"
exit "$status"
