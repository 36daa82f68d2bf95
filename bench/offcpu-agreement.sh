#!/usr/bin/env bash
# How closely sampled off-CPU time (the default) agrees with the exact context-switch tracer on
# the pg_stat_statements eviction storm, run after run. Each run is the test
# `sampled_waits_agree_with_the_exact_tracer_in_an_eviction_storm` (tests/tests/off_cpu_sampled.rs):
# 16 clients running 128 distinct statements into 100 entries, traced with --off-cpu=both for
# 120 s (PGSCOPE_STORM_SECONDS), each wait event's share (idle and client waits left out)
# compared with the exact tracer's in the same trace. The bounds of issue 20 are 5 pp per share
# and 10% on the total; the storm's test judges the sampler at its own runs instead and the
# exact state at the runs against the exact average within 0.5-1.5 (INSTANTS_OVER_AVERAGE in
# tests/tests/off_cpu_sampled.rs says why).
#
# Printed per run: the sampled total over the exact one, the largest share difference, and the
# exact state at the runs over the exact average (lock waits, time outside wait events: the
# runs' own disturbance); then how many runs passed the test. Ends with one line:
#   offcpu-agreement: runs=… within_bounds=… total_ratio_min=… total_ratio_median=… total_ratio_max=… max_share_pp=…
# A benchmark, not a test: it asserts nothing (the comparison's own verdict is only counted).
#
# Usage: bench/offcpu-agreement.sh [RUNS]   (needs root; real Postgres, real BPF)
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

source scripts/lib/storm-test.sh

runs=${1:-5}
storm_build

ratios=()
shares=()
within=0
for run in $(seq 1 "$runs"); do
    log=$(mktemp /tmp/pgscope-agreement.XXXXXX)
    if storm_run >"$log" 2>&1; then
        within=$((within + 1))
        verdict=within
    else
        verdict=outside
    fi
    line=$(grep -m1 '^agreement: workload=eviction-storm' "$log" || true)
    if [[ -z $line ]]; then
        echo "run $run: the comparison printed no agreement line; its output: $log" >&2
        exit 1
    fi
    ratio=$(sed -E 's/.*total_ratio=([0-9.]+).*/\1/' <<<"$line")
    share=$(sed -E 's/.*max_share_pp=([0-9.]+).*/\1/' <<<"$line")
    instants=$(sed -E 's/.*instants_waits_ratio=([0-9.]+) instants_no_wait_event_ratio=([0-9.]+).*/\1 and \2/' <<<"$line")
    ratios+=("$ratio")
    shares+=("$share")
    printf 'run %d: sampled/exact total %s, largest share difference %s pp, at the runs/average %s (%s the bounds)\n' \
        "$run" "$ratio" "$share" "$instants" "$verdict"
    rm -f "$log"
done

sorted=$(printf '%s\n' "${ratios[@]}" | sort -g)
min=$(head -1 <<<"$sorted")
max=$(tail -1 <<<"$sorted")
median=$(awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}' <<<"$sorted")
max_share=$(printf '%s\n' "${shares[@]}" | sort -g | tail -1)
echo "offcpu-agreement: runs=$runs within_bounds=$within total_ratio_min=$min" \
    "total_ratio_median=$median total_ratio_max=$max max_share_pp=$max_share"
