#!/usr/bin/env bash
# How `pgscope agent` scales with the backends and the statements of one instance, pushing to a
# real Grafana Pyroscope on loopback: its cost, what it ships and how many series Pyroscope ends
# up holding for the instance (issue 21).
# One throwaway cluster with pg_stat_statements and 50 small tables of 10 columns; pgbench
# (-M simple, where variables are pasted into the SQL text) runs `SELECT sum(c:a) FROM t:n
# WHERE c:b > :v` over every table and pair of columns, 5000 statement shapes and as many
# queryids, 19 transactions in 20, and a join ten times dearer over 10 shapes the 20th, so that
# the heaviest queryids stand out from a long flat tail (what the agent's top-K is for).
# For each backend count (100 and 1000): 50 busy pgbench clients at a fixed rate (-R: 1500 TPS,
# well within what 2 cores do), the other backends idle (one python3 process holds the
# connections and runs a light round-robin SELECT 1 over them); pgbench without the agent and
# with it (defaults, --frequency 19), interleaved, the order rotating from round to round, each
# run as long. With -R the TPS is the rate as long as the machine keeps up, so pgbench's average
# latency (counted from each transaction's scheduled start: schedule lag included) is compared
# too. Over each agent run, from its first upload on (the busy clients also run, unmeasured,
# while it makes that upload): its CPU (utime + stime, plus the time of its BPF programs that
# run in other tasks, from kernel.bpf_stats_enabled, switched on for the run and restored
# after), peak RSS, bytes and series pushed (a push: one profile type of one instance), series
# folded per reason, everything dropped or lost. After the agent runs of a count, the series Pyroscope holds for
# that count's service_name (scale-<backends>-<pid>) over the count's runs (Series API: one
# series per label set and profile type, which is what Pyroscope's per-tenant limit of active
# series counts, 5000 by default) and the distinct queryid label values (LabelValues). Each
# count pushes to a Pyroscope of its own, so that no count's series count against the next's.
# Then churn: pgbench -C (a new backend per transaction) at 150 connections/s for 60 s with the
# agent on: its CPU, RSS before and after, pushes failed, drops.
# Ends with one line (figures at the largest backend count; dropped: samples dropped in the
# agent + stacks dropped + BPF losses, the counters named lost* or *_full):
#   scale: backends=1000 queryids=… rss_mib=… cpu_pct=… push_kbps=… series_per_instance=… tps_ratio=… dropped=…
# A benchmark, not a test: it asserts nothing. About 10 minutes with the defaults.
#
# Usage: bench/scale.sh   (needs root; builds pgscope in release)
# Environment: PGSCOPE_SCALE_BACKENDS (backend counts, "100 1000"), PGSCOPE_SCALE_SECONDS (each
# pgbench run, 45), PGSCOPE_SCALE_ROUNDS (rounds of without/with the agent per count, 2),
# PGSCOPE_SCALE_BUSY (busy pgbench clients, 50), PGSCOPE_SCALE_RATE (their TPS, 1500),
# PGSCOPE_SCALE_IDLE_RATE (SELECT 1 per second over all the idle connections, 100),
# PGSCOPE_SCALE_TABLES (tables: queryids = 100 per table, 50), PGSCOPE_SCALE_CHURN_SECONDS (60),
# PGSCOPE_SCALE_CHURN_RATE (new connections per second, 150).
set -euo pipefail
shopt -s inherit_errexit   # a failure inside $(…) stops the run too
cd "$(dirname "$0")/.."
source scripts/lib/pgcluster.sh
source scripts/lib/free-port.sh
source scripts/lib/pyroscope.sh

read -ra backend_counts <<<"${PGSCOPE_SCALE_BACKENDS:-100 1000}"
secs=${PGSCOPE_SCALE_SECONDS:-45}
rounds=${PGSCOPE_SCALE_ROUNDS:-2}
busy=${PGSCOPE_SCALE_BUSY:-50}
rate=${PGSCOPE_SCALE_RATE:-1500}
idle_rate=${PGSCOPE_SCALE_IDLE_RATE:-100}
tables=${PGSCOPE_SCALE_TABLES:-50}
churn_secs=${PGSCOPE_SCALE_CHURN_SECONDS:-60}
churn_rate=${PGSCOPE_SCALE_CHURN_RATE:-150}
churn_clients=10
started=$SECONDS

scripts/install-deps.sh
cargo build --release --locked -q -p pgscope-agent
pgscope=$PWD/target/release/pgscope
work=$(mktemp -d /tmp/pgscope-scale.XXXXXX)
stats_before=$(sysctl -n kernel.bpf_stats_enabled)
pyroscope_pid='' pgscope_pid='' holder_pid='' churn_pid='' warm_pid=''
cleanup() {
  local pid
  for pid in "$pgscope_pid" "$holder_pid" "$churn_pid" "$warm_pid" "$pyroscope_pid"; do
    if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; fi
  done
  # Pyroscope is not this shell's child: its files go once it has exited.
  local tries=100
  while [[ -n $pyroscope_pid ]] && kill -0 "$pyroscope_pid" 2>/dev/null && ((tries-- > 0)); do
    sleep 0.1
  done
  sysctl -q -w kernel.bpf_stats_enabled="$stats_before"
  pgcluster_stop
  rm -rf "$work"
}
trap cleanup EXIT
sysctl -q -w kernel.bpf_stats_enabled=1
# Progress, on stderr, with the time since the start.
say() { printf 'scale.sh [%d:%02d] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*" >&2; }

# Where the agent pushes: a real Pyroscope on loopback (scripts/lib/pyroscope.sh; built once when
# the cache has none). A fresh server per phase (argument: its name): Pyroscope limits a tenant's
# active series (5000, kept 10 minutes after their last push), and every service of a server is
# the one tenant, so a server shared by the phases would count the 100 backends' series against
# the 1000's and could turn their pushes away.
start_pyroscope() {
  start_bench_pyroscope "$work/pyroscope-$1"
  push_to="Pyroscope on 127.0.0.1:$pyroscope_port"
  say "the agent pushes to $push_to"
}
stop_pyroscope() {
  if [[ -n $pyroscope_pid ]]; then
    kill "$pyroscope_pid" 2>/dev/null || true
    local tries=100
    while kill -0 "$pyroscope_pid" 2>/dev/null && ((tries-- > 0)); do sleep 0.1; done
    pyroscope_pid=
  fi
  rm -rf "$work/pyroscope-$1"
}

# What Pyroscope holds for service_name $1 from $2 to $3 (ms since the epoch): its series (one
# per label set and profile type) in $4.series.json, the queryid label's values in
# $4.queryids.json; empty files when it cannot answer.
query_pyroscope() {
  local matchers
  printf -v matchers '["{service_name=\\"%s\\"}"]' "$1"
  curl -sf -X POST -H 'Content-Type: application/json' "$push_url/querier.v1.QuerierService/Series" \
    -d "{\"matchers\": $matchers, \"start\": $2, \"end\": $3}" >"$4.series.json" || : >"$4.series.json"
  curl -sf -X POST -H 'Content-Type: application/json' "$push_url/querier.v1.QuerierService/LabelValues" \
    -d "{\"name\": \"queryid\", \"matchers\": $matchers, \"start\": $2, \"end\": $3}" \
    >"$4.queryids.json" || : >"$4.queryids.json"
}

# max_connections: the largest count, and room for psql, the agent's connection and pgbench's
# warm-up.
max_backends=0
for n in "${backend_counts[@]}"; do
  if ((n > max_backends)); then max_backends=$n; fi
done
(($(ulimit -n) > max_backends + 100)) || ulimit -n $((max_backends + 200))
pgcluster_start -c max_connections=$((max_backends + 100)) -c shared_preload_libraries=pg_stat_statements \
  -c pg_stat_statements.max=10000 -c checkpoint_timeout=30min -c max_wal_size=4GB
# pgc_pgbench for the runs this script stops itself: started in the background as one command,
# $! is runuser, which passes a kill on to pgbench (a function in the background is a subshell,
# whose kill would leave pgbench running).
pgbench_as_pg=(runuser -u "$PGC_USER" -- "$PGC_BINDIR/pgbench" -h "$PGC_WORK" -p "$PGC_PORT" -U postgres)

# The tables (1000 rows each: a statement costs little, the statements are many) and the two
# pgbench scripts. pgbench runs as postgres: it must read them.
pgc_psql -v tables="$tables" <<'SQL'
CREATE EXTENSION pg_stat_statements;
SELECT format('CREATE TABLE t%s AS SELECT %s FROM generate_series(1, 1000)', n, columns)
FROM generate_series(1, :tables) n,
     (SELECT string_agg(format('(random() * 1000)::int AS c%s', c), ', ') AS columns
      FROM generate_series(0, 9) c) x
\gexec
VACUUM ANALYZE;
SQL
sql=$work/sql
mkdir "$sql"
chmod 755 "$work" "$sql"
# Table × column summed × column filtered: 100 shapes per table, each its own queryid (the
# constant :v is normalized away).
cat >"$sql/wide.sql" <<EOF
\set n random(1, $tables)
\set a random(0, 9)
\set b random(0, 9)
\set v random(0, 1000)
SELECT sum(c:a) FROM t:n WHERE c:b > :v;
EOF
# A join of ~1 ms (ten times a wide statement or more) over 10 shapes.
cat >"$sql/heavy.sql" <<'EOF'
\set n random(1, 5)
\set b random(1, 2)
\set v random(0, 200)
SELECT count(*) FROM t:n x JOIN t:n y ON x.c0 % 50 = y.c:b % 50 WHERE x.c2 > :v;
EOF
chmod 644 "$sql"/*.sql
workload=(-n -M simple -f "$sql/wide.sql@19" -f "$sql/heavy.sql@1")
# Unthrottled for 10 s (~10 times the transactions needed to draw every shape): every queryid
# is in pg_stat_statements before the first phase, and the cache is warm.
pgc_psql -c 'SELECT pg_stat_statements_reset()' >/dev/null
pgc_pgbench "${workload[@]}" -c "$busy" -j 2 -T 10 postgres >/dev/null 2>&1
say "$(pgc_psql -c 'SELECT count(*) FROM pg_stat_statements') queryids in pg_stat_statements"

# Waits up to SECONDS for a line matching PATTERN in FILE, written by process PID; on a timeout
# or the process gone first, prints WHAT and the file and stops the run.
await_line() {
  local file=$1 pattern=$2 pid=$3 seconds=$4 what=$5
  for _ in $(seq "$((seconds * 10))"); do
    grep -q "$pattern" "$file" && return
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  grep -q "$pattern" "$file" || { echo "$what:" >&2; cat "$file" >&2; exit 1; }
}

# utime + stime of a process, in clock ticks (its children are not counted).
cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
stime_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $13}'; }

# run_cnt and run_time_ns of the BPF programs the process holds (found through the prog_id of its
# file descriptors, so that programs of other pgscope processes on the host are left out), per
# program: "wait_sampler_cnt wait_sampler_ns on_switch_cnt on_switch_ns on_cpu_sample_cnt
# on_cpu_sample_ns other_cnt other_ns" (other: all its other programs together).
bpf_stats() {
  local ids
  mapfile -t ids < <(sed -n 's/^prog_id:[[:space:]]*//p' "/proc/$1"/fdinfo/* 2>/dev/null | sort -u)
  bpftool prog show --json | python3 -c '
import json, sys
ids = {int(i) for i in sys.argv[1:]}
progs = [p for p in json.load(sys.stdin) if p["id"] in ids]
# The wait sampler programs (kernel names, 15 characters): the kfunc passes, or the iterators.
wait_sampler = ("target_waits", "target_wait_sta", "target_waits_fl", "sample_waits", "sample_wait_sta")
groups = (wait_sampler, ("on_switch",), ("on_cpu_sample",))
named = [name for group in groups for name in group]
print(*(sum(p.get(k, 0) for p in progs if p.get("name") in group) for group in groups for k in ("run_cnt", "run_time_ns")),
      *(sum(p.get(k, 0) for p in progs if p.get("name") not in named) for k in ("run_cnt", "run_time_ns")))' "${ids[@]}"
}
# BPF time in ns of the process's programs that run in the context of other tasks (every one but
# the wait sampler, which runs in its sampler thread: already in its CPU time).
bpf_outside_ns() { bpf_stats "$1" | awk '{print $4 + $6 + $8}'; }

# Follows a child process until it exits (a zombie has no VmHWM) and prints the last peak RSS
# read, in KiB (or the second argument, read before, when it is gone at once).
peak_rss_until_exit() {
  local hwm=${2:-0} v
  while v=$(awk '/^VmHWM/ {print $2}' "/proc/$1/status" 2>/dev/null) && [[ -n $v ]]; do
    hwm=$v
    sleep 0.05
  done
  echo "$hwm"
}
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

start_agent() {
  metrics_port=$(free_port)
  "$pgscope" agent --config "$work/agent.toml" --metrics-addr "127.0.0.1:$metrics_port" "$@" \
    2>"$work/agent.log" &
  pgscope_pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$metrics_port/readyz" >/dev/null 2>&1 && return
    kill -0 "$pgscope_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "the agent did not become ready:" >&2; cat "$work/agent.log" >&2; exit 1
}
# Waits until the agent has ended its first upload (pushed or not), so that a window measures the
# steady state: the first interval also reads the kernel's symbols, maps and symbolizes every
# backend's binary once and discovers the instance. Its later uploads, one every 15 s, fall in
# the window.
await_first_push() {
  for _ in $(seq 600); do
    local metrics
    metrics=$(curl -sf "http://127.0.0.1:$metrics_port/metrics" 2>/dev/null || true)
    grep -qE '^pgscope_export_pushes_total\{[^}]*\} [1-9]' <<<"$metrics" && return
    kill -0 "$pgscope_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "the agent made no upload within 60 s:" >&2; cat "$work/agent.log" >&2; exit 1
}
# The agent's /metrics into a file (the report takes the differences between two of them).
save_metrics() { curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$1" || : >"$1"; }

# Stops the agent; sets agent_rss to its peak RSS in KiB. What it logged as a warning or an
# error goes into the notes printed with the results.
stop_agent() {
  agent_rss=$(awk '/^VmHWM/ {print $2}' "/proc/$pgscope_pid/status" 2>/dev/null || echo 0)
  kill -TERM "$pgscope_pid"
  agent_rss=$(peak_rss_until_exit "$pgscope_pid" "$agent_rss")
  wait "$pgscope_pid" || { echo "the agent failed:" >&2; cat "$work/agent.log" >&2; exit 1; }
  pgscope_pid=
  grep -E ' (WARN|ERROR) ' "$work/agent.log" | sed 's/^[^ ]* *//; s/^/agent: /' >>"$work/notes" || true
}

# The busy clients for $secs at $rate TPS; prints "tps latency_ms backends", backends being the
# client backends of the holder and pgbench seen 5 s in (or halfway through a shorter run).
busy_pgbench() {
  local pid seen tps lat
  pgc_pgbench "${workload[@]}" -c "$busy" -j 2 -R "$rate" -T "$secs" postgres \
    >"$work/pgbench.out" 2>"$work/pgbench.err" &
  pid=$!
  sleep $((secs < 10 ? secs / 2 : 5))
  seen=$(pgc_psql -c "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name IN ('pgbench', 'scale-bench-idle')")
  wait "$pid" || { echo "pgbench failed:" >&2; cat "$work/pgbench.err" >&2; exit 1; }
  tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$work/pgbench.out")
  lat=$(sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p' "$work/pgbench.out")
  echo "$tps $lat $seen"
}

# One pgbench run of a phase, without or with the agent; appends to $work/runs
# "backends round variant tps latency_ms backends_seen wall_s cpu_s stime_s bpf_outside_ns
# rss_kib metrics_before metrics_after" (the agent's figures 0 and - without it).
run_variant() {
  local n=$1 round=$2 variant=$3 out tps lat seen
  # Through a variable: the status of a $(…) inside a here-string is lost.
  if [[ $variant == base ]]; then
    out=$(busy_pgbench)
    read -r tps lat seen <<<"$out"
    echo "$n $round base $tps $lat $seen 0 0 0 0 0 - -" >>"$work/runs"
  else
    local c0 s0 b0 t0 c1 s1 b1 t1 before=$work/metrics-$n-$round-0 after=$work/metrics-$n-$round-1
    # The busy clients run during the agent's first interval too: the idle connections alone
    # give it a sample every ten seconds or so (an interval without one sends nothing, and the
    # first upload could wait for minutes), and the window then starts with pgbench's
    # backends' binary mapped and symbolized.
    "${pgbench_as_pg[@]}" "${workload[@]}" -c "$busy" -j 2 -R "$rate" -T 120 postgres >/dev/null 2>&1 &
    warm_pid=$!
    start_agent --frequency 19
    await_first_push
    kill "$warm_pid"; wait "$warm_pid" 2>/dev/null || true; warm_pid=
    save_metrics "$before"
    c0=$(cpu_ticks "$pgscope_pid"); s0=$(stime_ticks "$pgscope_pid"); b0=$(bpf_outside_ns "$pgscope_pid")
    t0=$EPOCHREALTIME
    out=$(busy_pgbench)
    t1=$EPOCHREALTIME
    read -r tps lat seen <<<"$out"
    c1=$(cpu_ticks "$pgscope_pid"); s1=$(stime_ticks "$pgscope_pid"); b1=$(bpf_outside_ns "$pgscope_pid")
    save_metrics "$after"
    stop_agent
    python3 -c '
import os, sys
hz = os.sysconf("SC_CLK_TCK")
t0, t1, c0, c1, s0, s1 = map(float, sys.argv[2:8])
print(sys.argv[1], t1 - t0, (c1 - c0) / hz, (s1 - s0) / hz, int(sys.argv[9]) - int(sys.argv[8]), *sys.argv[10:])' \
      "$n $round agent $tps $lat $seen" "$t0" "$t1" "$c0" "$c1" "$s0" "$s1" "$b0" "$b1" \
      "$agent_rss" "$before" "$after" >>"$work/runs"
  fi
  say "$n backends, round $round, $variant: $tps TPS, latency $lat ms"
}

# The idle connections of a phase (bench/hold_connections.py): SELECT 1 round-robin at
# $idle_rate per second over all of them, so every backend wakes now and then and nearly all are
# idle at any instant.
start_holder() {
  python3 bench/hold_connections.py "$PGC_WORK/.s.PGSQL.$PGC_PORT" "$1" "$idle_rate" scale-bench-idle \
    >"$work/holder.out" 2>&1 &
  holder_pid=$!
  await_line "$work/holder.out" '^held' "$holder_pid" 120 "cannot hold $1 connections"
}
stop_holder() {
  if [[ -n $holder_pid ]]; then
    kill "$holder_pid"; wait "$holder_pid" 2>/dev/null || true; holder_pid=
  fi
}

# The agent at its defaults but for the service_name, which tells the phases apart in Pyroscope.
write_agent_config() {
  cat >"$work/agent.toml" <<EOF
[pyroscope]
url = "$push_url"
[[discovery.include]]
data_dir = "$PGC_DATA"
[labels]
service_name = "$1"
EOF
}

: >"$work/runs"; : >"$work/notes"
for n in "${backend_counts[@]}"; do
  service=scale-$n-$$
  start_pyroscope "$n"
  write_agent_config "$service"
  idle=$((n > busy ? n - busy : 0))
  if ((idle > 0)); then start_holder "$idle"; fi
  say "$n backends: $idle idle connections held, $busy busy clients"
  from_ms=$(date +%s%3N)
  variants=(base agent)
  for ((r = 1; r <= rounds; r++)); do
    # Rotated from round to round, so that neither always runs first.
    for ((i = 0; i < ${#variants[@]}; i++)); do
      run_variant "$n" "$r" "${variants[(i + r - 1) % ${#variants[@]}]}"
    done
  done
  to_ms=$(date +%s%3N)
  query_pyroscope "$service" "$from_ms" "$to_ms" "$work/pyroscope-$n"
  {
    echo "service $service"
    echo "window_s $(((to_ms - from_ms) / 1000))"
    echo "queryids_held $(pgc_psql -c 'SELECT count(*) FROM pg_stat_statements')"
    echo "push_to $push_to"
  } >"$work/phase-$n"
  stop_holder
  stop_pyroscope "$n"
done

# Churn: the agent follows every fork and forgets every exit. pgbench -C starts first (the
# agent's first upload needs samples to send) and outlives the window; sessions from
# pg_stat_database.
say "churn"
start_pyroscope churn
write_agent_config "scale-churn-$$"
sessions() { pgc_psql -c "SELECT sessions FROM pg_stat_database WHERE datname = 'postgres'"; }
"${pgbench_as_pg[@]}" -n -C -M simple -f "$sql/wide.sql" -c "$churn_clients" -j 2 -R "$churn_rate" \
  -T $((churn_secs + 120)) postgres >"$work/churn.out" 2>&1 &
churn_pid=$!
start_agent --frequency 19
await_first_push
save_metrics "$work/metrics-churn-0"
c0=$(cpu_ticks "$pgscope_pid"); b0=$(bpf_outside_ns "$pgscope_pid"); rss0=$(rss_kib "$pgscope_pid")
t0=$EPOCHREALTIME; sessions0=$(sessions)
# RSS every 15 s: a steady climb (state kept per process gone) tells apart from a warm-up.
rss_trace=()
for ((left = churn_secs; left > 0; left -= 15)); do
  sleep $((left < 15 ? left : 15))
  rss_trace+=("$(rss_kib "$pgscope_pid")")
done
t1=$EPOCHREALTIME; sessions1=$(sessions)
c1=$(cpu_ticks "$pgscope_pid"); b1=$(bpf_outside_ns "$pgscope_pid"); rss1=$(rss_kib "$pgscope_pid")
save_metrics "$work/metrics-churn-1"
stop_agent
kill "$churn_pid"; wait "$churn_pid" 2>/dev/null || true; churn_pid=
python3 -c '
import os, sys
t0, t1, c0, c1 = map(float, sys.argv[1:5])
b0, b1, s0, s1 = map(int, sys.argv[5:9])
print("wall_s", t1 - t0); print("cpu_s", (c1 - c0) / os.sysconf("SC_CLK_TCK")); print("bpf_outside_ns", b1 - b0)
print("sessions", s1 - s0)' "$t0" "$t1" "$c0" "$c1" "$b0" "$b1" "$sessions0" "$sessions1" >"$work/churn"
{
  echo "rss_before_kib $rss0"
  echo "rss_after_kib $rss1"
  echo "rss_trace_kib ${rss_trace[*]}"
  echo "rss_peak_kib $agent_rss"
  echo "push_to $push_to"
} >>"$work/churn"
stop_pyroscope churn

{
  echo "backends ${backend_counts[*]}"
  echo "secs $secs"
  echo "rounds $rounds"
  echo "busy $busy"
  echo "rate $rate"
  echo "idle_rate $idle_rate"
  echo "tables $tables"
  echo "churn_secs $churn_secs"
  echo "churn_rate $churn_rate"
  echo "churn_clients $churn_clients"
  echo "elapsed $((SECONDS - started))"
} >"$work/params"
python3 bench/scale_report.py "$work"
