#!/usr/bin/env bash
# What pgscope's Postgres awareness costs, measured side by side in one run on one cluster
# (pgbench -S -M prepared, pg_stat_statements loaded), rounds interleaved so drift hits all:
#   - the default trace (sampling at 99 Hz + attribution + phases from stacks) vs no agent;
#   - pg_stat_statements.track_planning = on vs off, the only per-statement phase timing
#     Postgres itself offers;
#   - each function probe alone (every call measured): TPS ratio, calls/s and the cost per call
#     in situ, next to `pgscope calibrate`'s floor (a uprobe running an empty program);
#   - every probe at once under the default overhead budget (2% of the instance's CPU).
# A benchmark, not a test: it asserts nothing.
#
# Usage: bench/probes.sh [ROUNDS] [SECONDS_PER_RUN]   (needs root; builds pgscope in release)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/pgcluster.sh

rounds=${1:-2}
secs=${2:-10}
clients=${PGSCOPE_BENCH_CLIENTS:-2}
probes=(LockRelationOid GetCachedPlan PortalStart _bt_getroot)

scripts/install-deps.sh
cargo build --release --locked -q -p pgscope-agent
pgscope=$PWD/target/release/pgscope
work=$(mktemp -d /tmp/pgscope-bench.XXXXXX)
trap 'pgcluster_stop; rm -rf "$work"' EXIT

"$pgscope" calibrate | sed 's/^/calibrate: /'

pgcluster_start -c shared_preload_libraries=pg_stat_statements
pgc_psql -c "CREATE EXTENSION pg_stat_statements" >/dev/null
pgc_pgbench -i -q -s 10 postgres >/dev/null 2>&1
run_pgbench() {
  pgc_pgbench -S -M prepared -c "$clients" -j "$clients" -T "$secs" postgres 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}
set_track_planning() {
  pgc_psql -c "ALTER SYSTEM SET pg_stat_statements.track_planning = $1" -c "SELECT pg_reload_conf()" >/dev/null
}
# Runs pgbench under `pgscope trace` with the given extra arguments; prints "tps calls_per_s".
run_traced() {
  local json="$work/trace.json"
  "$pgscope" trace --instance "$PGC_DATA" --duration "$((secs + 2))s" --top 0 --json "$json" "$@" \
    >/dev/null 2>"$work/trace.err" &
  local trace_pid=$!
  # Sampling and probes are attached once pgscope says it profiles.
  for _ in $(seq 100); do grep -q '^pgscope: profiling' "$work/trace.err" && break; sleep 0.1; done
  local tps; tps=$(run_pgbench)
  wait "$trace_pid" || { cat "$work/trace.err" >&2; exit 1; }
  local calls; calls=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(p["calls_per_second"] for p in d["probes"]))' "$json")
  echo "$tps $calls"
}

run_pgbench >/dev/null   # warm the cache
declare -A tps
for ((r = 1; r <= rounds; r++)); do
  tps[base]+=" $(run_pgbench)"
  tps[default]+=" $(run_traced | cut -d' ' -f1)"
  tps[budget]+=" $(run_traced --probes all | cut -d' ' -f1)"
  set_track_planning on
  tps[track_planning]+=" $(run_pgbench)"
  set_track_planning off
  for p in "${probes[@]}"; do
    read -r t c < <(run_traced --probes "$p" --probe-budget none)
    tps[$p]+=" $t"
    tps[$p.calls]+=" $c"
  done
  echo "round $r done" >&2
done

python3 - "$clients" "${probes[*]}" <<PY
import statistics as st, sys
clients, probes = int(sys.argv[1]), sys.argv[2].split()
runs = {k: [float(x) for x in v.split()] for k, v in {
$(for k in "${!tps[@]}"; do printf '    "%s": "%s",\n' "$k" "${tps[$k]}"; done)
}.items()}
base = st.mean(runs["base"])
print(f"pgbench -S -M prepared, {clients} clients: {base:.0f} TPS without pgscope")
print(f"default trace (99 Hz sampling + attribution + phases): ratio {st.mean(runs['default']) / base:.3f}")
print(f"pg_stat_statements.track_planning = on (no pgscope):    ratio {st.mean(runs['track_planning']) / base:.3f}")
print(f"--probes all under the default budget (2% of CPU):       ratio {st.mean(runs['budget']) / base:.3f}")
print("function probes, every call measured (cost per call in situ = lost TPS share x CPU time / calls):")
for p in probes:
    ratio = st.mean(runs[p]) / base
    calls = st.mean(runs[p + ".calls"])
    # The workload saturates the machine: lost throughput is CPU the probe took.
    cpu_ns = (1 - ratio) * clients * 1e9
    per_call = cpu_ns / calls if calls > 0 else float("nan")
    print(f"  {p:<18} ratio {ratio:.3f}  {calls:>9.0f} calls/s  ~{per_call:.0f} ns per call")
PY
