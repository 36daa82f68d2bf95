#!/usr/bin/env bash
# What off-CPU profiling costs on a busy Postgres: pgbench -S TPS under `pgscope trace --instance`
# with `--off-cpu` vs without it, and without pgscope at all, interleaved in one run on
# one cluster so that drift hits all alike. Also prints the off-CPU programs' events per second
# and BPF time per event, from the kernel's BPF statistics (kernel.bpf_stats_enabled, switched
# on for the run and restored after). Beside them, the floor: pgbench under an empty program on
# sched_switch (bench/switch_floor), what any off-CPU profiler hooked on every context switch
# pays before doing anything. A benchmark, not a test: it asserts nothing.
#
# Usage: bench/offcpu.sh [ROUNDS] [SECONDS_PER_RUN]   (needs root; builds pgscope in release)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/pgcluster.sh

rounds=${1:-3}
secs=${2:-15}
clients=${PGSCOPE_BENCH_CLIENTS:-2}

scripts/install-deps.sh
cargo build --release --locked -q -p pgscope-agent
pgscope=$PWD/target/release/pgscope
work=$(mktemp -d /tmp/pgscope-bench.XXXXXX)
stats_before=$(sysctl -n kernel.bpf_stats_enabled)
trap 'sysctl -q -w kernel.bpf_stats_enabled="$stats_before"; pgcluster_stop; rm -rf "$work"' EXIT
sysctl -q -w kernel.bpf_stats_enabled=1

clang -g -O2 -target bpf -I"/usr/include/$(gcc -print-multiarch)" -Wall -Werror \
  -c bench/switch_floor/floor.bpf.c -o "$work/floor.bpf.o"
cc -O2 -Wall -Werror bench/switch_floor/floor.c -o "$work/floor" -lbpf

pgcluster_start
pgc_pgbench -i -q -s 10 postgres >/dev/null 2>&1
pgc_pgbench -S -c "$clients" -j "$clients" -T 5 postgres >/dev/null 2>&1   # warm the cache

run_pgbench() {
  local out
  out=$(pgc_pgbench -S -c "$clients" -j "$clients" -T "$secs" postgres 2>"$work/pgbench.err") ||
    { echo "pgbench failed:" >&2; cat "$work/pgbench.err" >&2; exit 1; }
  sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out"
}

# run_cnt and run_time_ns of pgscope's off-CPU programs, summed: "count ns".
bpf_stats() {
  bpftool prog show --json | python3 -c '
import json, sys
progs = [p for p in json.load(sys.stdin) if p.get("name") == "on_switch"]
print(sum(p.get("run_cnt", 0) for p in progs), sum(p.get("run_time_ns", 0) for p in progs))'
}

# Runs pgbench under `pgscope trace` with the given extra arguments; prints "tps events ns".
run_traced() {
  "$pgscope" trace --instance "$PGC_DATA" --duration "$((secs + 3))s" --top 0 "$@" \
    >/dev/null 2>"$work/trace.err" &
  local trace_pid=$!
  for _ in $(seq 100); do grep -q '^pgscope: profiling' "$work/trace.err" && break; sleep 0.1; done
  local before; before=$(bpf_stats)
  local tps; tps=$(run_pgbench)
  local after; after=$(bpf_stats)
  wait "$trace_pid" || { cat "$work/trace.err" >&2; exit 1; }
  python3 -c 'import sys; b, a = [list(map(int, x.split())) for x in sys.argv[1:3]]; print(sys.argv[3], a[0] - b[0], a[1] - b[1])' \
    "$before" "$after" "$tps"
}

# pgbench's TPS with the empty sched_switch program attached.
run_floor() {
  "$work/floor" "$work/floor.bpf.o" >"$work/floor.out" 2>&1 &
  local floor_pid=$!
  for _ in $(seq 100); do grep -q '^attached' "$work/floor.out" && break; sleep 0.1; done
  grep -q '^attached' "$work/floor.out" || { cat "$work/floor.out" >&2; exit 1; }
  run_pgbench
  kill "$floor_pid"
  wait "$floor_pid"
}

declare -a base floor on off events ns
for ((r = 1; r <= rounds; r++)); do
  base+=("$(run_pgbench)")
  floor+=("$(run_floor)")
  read -r t e n < <(run_traced --off-cpu)
  on+=("$t"); events+=("$e"); ns+=("$n")
  read -r t _ _ < <(run_traced)
  off+=("$t")
  echo "round $r: tps without pgscope ${base[-1]}, empty sched_switch program ${floor[-1]}, trace ${off[-1]}, trace --off-cpu ${on[-1]}" >&2
done

python3 - "$secs" "$clients" "${base[*]}" "${off[*]}" "${on[*]}" "${events[*]}" "${ns[*]}" "${floor[*]}" <<'PY'
import statistics as st, sys
secs, clients = float(sys.argv[1]), sys.argv[2]
base, off, on, events, ns, floor = ([float(x) for x in a.split()] for a in sys.argv[3:9])
print(f"pgbench -S, {clients} clients: {st.mean(base):.0f} TPS without pgscope")
print(f"empty sched_switch program / without: {st.mean(floor) / st.mean(base):.3f}; per round "
      + " ".join(f"{f / b:.3f}" for f, b in zip(floor, base)))
print(f"trace / without: {st.mean(off) / st.mean(base):.3f}")
print(f"trace --off-cpu / without: {st.mean(on) / st.mean(base):.3f}")
print(f"off-CPU on vs off (both traced): ratio {st.mean(on) / st.mean(off):.3f}; per round "
      + " ".join(f"{o / f:.3f}" for o, f in zip(on, off)))
per_s = st.mean(events) / secs
per_event = sum(ns) / max(sum(events), 1)
print(f"off-CPU programs: {per_s:.0f} events/s (sched_switch, host-wide), "
      f"{per_event:.0f} ns of BPF time per event, {per_s * per_event / 1e7:.2f}% of one CPU")
PY
