#!/usr/bin/env bash
# Where the sampled off-CPU time of the pg_stat_statements eviction storm goes wrong, against a
# ground truth: perf records every context switch of the host (with kernel stacks) while the
# test `sampled_waits_agree_with_the_exact_tracer_in_an_eviction_storm` runs (16 clients,
# 128 statements into 100 entries, traced with --off-cpu=both). bench/offcpu_groundtruth.py then
# compares, per class (futex, preempted, io), perf's time, perf's state at the wait sampler's
# own instants, and the exact and sampled tracers' figures, counts the threads that changed
# state between an instant and the end of the sampler's run, and draws a perfect sampler's
# noise floor (as many random instants, judged by perf's record).
#
# perf recording every switch slows the storm (its waits come out shorter and rarer than
# without), so the figures say where the error comes from, not how large it is unrecorded:
# bench/offcpu-agreement.sh measures that. Ends with one line per run:
#   offcpu-groundtruth: futex_exact_over_truth=… futex_instants_over_truth=…
#   futex_sampled_over_instants=… preempted_…=… ran_during_run_per_instant=…
#   perfect_futex_within_10pct=… perfect_comparable_within_10pct=…
# A benchmark, not a test: it asserts nothing.
#
# Usage: bench/offcpu-groundtruth.sh [RUNS]   (needs root; real Postgres, real BPF, perf)
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

source scripts/lib/storm-test.sh

runs=${1:-1}
storm_build

work=$(mktemp -d /tmp/pgscope-groundtruth.XXXXXX)
perf_pid=
cleanup() {
    if [[ -n $perf_pid ]]; then
        kill -INT "$perf_pid" 2>/dev/null || true
        wait "$perf_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

for run in $(seq 1 "$runs"); do
    perf record -q -e sched:sched_switch -a -g --kernel-callchains -m 4096 \
        -o "$work/perf.data" 2>"$work/perf.err" &
    perf_pid=$!
    sleep 2
    # 20 s, not the test's 200: perf records every switch of the storm.
    PGSCOPE_STORM_SECONDS=20 storm_run >"$work/test.log" 2>&1 || true
    kill -INT "$perf_pid"
    wait "$perf_pid" || true
    perf_pid=
    echo "run $run: $(grep -m1 '^agreement:' "$work/test.log" || echo 'the test printed no agreement line')"
    perf script -i "$work/perf.data" -F comm,time,trace,ip,sym 2>/dev/null |
        python3 bench/offcpu_groundtruth.py "$work/test.log"
    rm -f "$work/perf.data"
done
