#!/usr/bin/env bash
# Overhead of `pgscope trace --instance` on a busy Postgres: pgbench -S TPS with the profiler
# attached vs without, interleaved A/B/A/B in one run on one cluster so that drift (caches,
# thermal, other load) hits both sides alike. Prints the ratio, and pgscope's own CPU time and
# peak RSS. A benchmark, not a test: it asserts nothing.
#
# Usage: bench/overhead.sh [ROUNDS] [SECONDS_PER_RUN]   (needs root; builds pgscope in release)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/pgcluster.sh

rounds=${1:-3}
secs=${2:-20}
frequency=${PGSCOPE_BENCH_HZ:-99}
clients=${PGSCOPE_BENCH_CLIENTS:-2}

scripts/install-deps.sh
cargo build --release --locked -q -p pgscope-agent
pgscope=$PWD/target/release/pgscope

trap pgcluster_stop EXIT
pgcluster_start
pgc_pgbench -i -q -s 10 postgres >/dev/null 2>&1
pgc_pgbench -S -c "$clients" -j "$clients" -T 5 postgres >/dev/null 2>&1   # warm the cache

run_pgbench() {
  pgc_pgbench -S -c "$clients" -j "$clients" -T "$secs" postgres 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}

declare -a base with cpu rss
for ((r = 1; r <= rounds; r++)); do
  base+=("$(run_pgbench)")
  # The trace outlives pgbench by a little so that the whole pgbench run is profiled.
  /usr/bin/time -f '%U %S %M' -o /tmp/pgscope-bench-time.$$ \
    "$pgscope" trace --instance "$PGC_DATA" --frequency "$frequency" --duration "$((secs + 3))s" \
      --top 0 >/dev/null 2>/tmp/pgscope-bench-err.$$ &
  trace_pid=$!
  sleep 1   # attach time; pgbench must not start before sampling does
  with+=("$(run_pgbench)")
  wait "$trace_pid" || { cat /tmp/pgscope-bench-err.$$ >&2; exit 1; }
  read -r user sys maxrss < /tmp/pgscope-bench-time.$$
  cpu+=("$(echo "$user + $sys" | bc -l)")
  rss+=("$maxrss")
  echo "round $r: tps without ${base[-1]}  with ${with[-1]}  (pgscope cpu ${cpu[-1]} s, peak rss ${rss[-1]} KiB)"
done
rm -f /tmp/pgscope-bench-time.$$ /tmp/pgscope-bench-err.$$

python3 - "$frequency" "$secs" "${base[*]}" "${with[*]}" "${cpu[*]}" "${rss[*]}" <<'PY'
import statistics as st, sys
hz, secs = sys.argv[1], float(sys.argv[2])
base, with_, cpu, rss = ([float(x) for x in a.split()] for a in sys.argv[3:7])
ratio = st.mean(with_) / st.mean(base)
# Each round is an adjacent pair, so its own ratio cancels slow drift; the median of those
# ratios is robust to one round disturbed by something else on the machine.
pair_ratios = [w / b for w, b in zip(with_, base)]
median = st.median(pair_ratios)
print(f"pgbench -S TPS without pgscope: {st.mean(base):.0f}  with pgscope trace at {hz} Hz: {st.mean(with_):.0f}")
print(f"per-round ratios with/without: {' '.join(f'{r:.3f}' for r in pair_ratios)}")
print(f"median ratio: {median:.3f} (overhead {100 * (1 - median):.1f}%); ratio of means: {ratio:.3f}")
print(f"pgscope CPU: {st.mean(cpu):.2f} s per {secs + 3:.0f} s trace ({100 * st.mean(cpu) / (secs + 3):.1f}% of one core); peak RSS {max(rss) / 1024:.1f} MiB")
PY
