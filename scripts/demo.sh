#!/usr/bin/env bash
# make demo: start a throwaway Postgres 15 cluster in a temp dir on a free port, load it with
# pgbench, profile the whole instance with pgscope for 15 s, print the top functions and write
# on-CPU and off-CPU flamegraphs. Everything is torn down at the end, also on Ctrl-C or error.
set -euo pipefail
source "$(dirname "$0")/lib/pgcluster.sh"

pgscope=${1:?usage: demo.sh PATH_TO_PGSCOPE}
out_dir=${PGSCOPE_DEMO_OUT:-$PWD}

cleanup() {
  [[ -n ${bench_pid:-} ]] && kill "$bench_pid" 2>/dev/null || true
  pgcluster_stop
}
trap cleanup EXIT

# pg_stat_statements turns queryids on (compute_query_id = auto) and gives the texts.
pgcluster_start -c shared_preload_libraries=pg_stat_statements
echo "demo: throwaway Postgres 15 cluster on port $PGC_PORT in $PGC_WORK"
pgc_psql -c "CREATE EXTENSION pg_stat_statements" >/dev/null
pgc_pgbench -i -q -s 10 postgres >/dev/null 2>&1

echo "demo: running pgbench (2 clients, TPC-B-like) and profiling the instance for 15 s"
pgc_pgbench -c 2 -j 2 -T 25 postgres >"$PGC_WORK/pgbench.log" 2>&1 &
bench_pid=$!
"$pgscope" trace --instance "$PGC_DATA" --duration 15s --frequency 99 --top 10 --off-cpu \
  --svg "$out_dir/pgscope-demo.svg" --folded "$out_dir/pgscope-demo.folded" \
  --report "$out_dir/pgscope-demo.html"
wait "$bench_pid" 2>/dev/null || true
bench_pid=
grep -E '^tps' "$PGC_WORK/pgbench.log" | head -1 | sed 's/^/demo: pgbench /' || true
echo "demo: open $out_dir/pgscope-demo.html in a browser: the findings, both flamegraphs and a"
echo "      table per query; or $out_dir/pgscope-demo.svg (on CPU) and"
echo "      $out_dir/pgscope-demo.offcpu.svg (where backends waited, by wait event) alone"
