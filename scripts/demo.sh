#!/usr/bin/env bash
# make demo: start a throwaway Postgres 15 cluster in a temp dir on a free port, load it with
# pgbench, profile the whole instance with pgscope for 15 s, print the top functions and write
# a flamegraph. Everything is torn down at the end, also on Ctrl-C or error.
set -euo pipefail

pgscope=${1:?usage: demo.sh PATH_TO_PGSCOPE}
bindir=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
out_dir=${PGSCOPE_DEMO_OUT:-$PWD}
run_as=postgres    # initdb and postgres refuse to run as root

work=$(mktemp -d /tmp/pgscope-demo.XXXXXX)
chown "$run_as" "$work"
data="$work/data"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
as_pg() { runuser -u "$run_as" -- "$@"; }

cleanup() {
  [[ -n ${bench_pid:-} ]] && kill "$bench_pid" 2>/dev/null || true
  as_pg "$bindir/pg_ctl" -D "$data" stop -m immediate >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "demo: starting a throwaway Postgres 15 cluster on port $port in $work"
as_pg "$bindir/initdb" -D "$data" -U postgres --auth=trust >/dev/null
as_pg "$bindir/pg_ctl" -D "$data" -w -l "$work/postgres.log" \
  -o "-p $port -k $work -c listen_addresses=127.0.0.1 -c shared_buffers=128MB" start >/dev/null
pgbench=("$bindir/pgbench" -h "$work" -p "$port" -U postgres)
as_pg "${pgbench[@]}" -i -q -s 10 postgres >/dev/null 2>&1

echo "demo: running pgbench (2 clients, select-only) and profiling the instance for 15 s"
as_pg "${pgbench[@]}" -S -c 2 -j 2 -T 25 postgres >"$work/pgbench.log" 2>&1 &
bench_pid=$!
"$pgscope" trace --instance "$data" --duration 15s --frequency 99 --top 15 \
  --svg "$out_dir/pgscope-demo.svg" --folded "$out_dir/pgscope-demo.folded"
wait "$bench_pid" 2>/dev/null || true
bench_pid=
grep -E '^tps' "$work/pgbench.log" | head -1 | sed 's/^/demo: pgbench /' || true
echo "demo: open $out_dir/pgscope-demo.svg in a browser to explore the flamegraph"
