#!/usr/bin/env bash
# What off-CPU profiling costs a busy Postgres, in one run on one cluster so that drift hits all
# alike. Two workloads, pgbench -S (read-only) and pgbench's TPC-B-like default script with
# synchronous_commit=on, each run without pgscope, under `pgscope trace` at its defaults (on-CPU
# + sampled off-CPU), under `pgscope trace --off-cpu=exact` (the sched_switch tracer), under
# `pgscope agent` at its defaults (pushing to a Pyroscope on loopback), and under an empty
# program on sched_switch (bench/switch_floor: what any tracer hooked on every context switch
# pays before it does anything, the floor under --off-cpu=exact). The variants are interleaved
# and their order rotates from round to round. Printed: TPS ratios against no pgscope (mean and
# per round), pgscope's CPU (utime + stime over the pgbench run) and peak RSS, and where BPF
# time goes (run_cnt / run_time_ns of the wait sampler's programs, on_switch, on_cpu_sample and pgscope's other
# programs, from kernel.bpf_stats_enabled, switched on for the run and restored after).
# Then the agent (defaults, --frequency 19) with 10, 100 and 1000 connected backends, most of
# them idle (one python3 process holds the connections and runs a light round-robin load of
# SELECT 1), over a fixed window with no pgbench, after its first upload: its CPU in % of one
# core.
# Ends with one line:
#   offcpu: trace_ratio=… agent_ratio=… exact_ratio=… cpu_pct_1000_backends=…
# A benchmark, not a test: it asserts nothing.
#
# Usage: bench/offcpu.sh [ROUNDS] [SECONDS_PER_RUN]   (needs root; builds pgscope in release)
# Environment: PGSCOPE_BENCH_CLIENTS (pgbench clients, 2), PGSCOPE_BENCH_IDLE_WINDOW (seconds
# measured per backend count, 30), PGSCOPE_BENCH_IDLE_RATE (SELECT 1 per second over all held
# connections, 100).
set -euo pipefail
shopt -s inherit_errexit   # a failure inside $(…) stops the run too
cd "$(dirname "$0")/.."
source scripts/lib/pgcluster.sh
source scripts/lib/free-port.sh
source scripts/lib/pyroscope.sh

rounds=${1:-3}
secs=${2:-15}
clients=${PGSCOPE_BENCH_CLIENTS:-2}
idle_window=${PGSCOPE_BENCH_IDLE_WINDOW:-30}
idle_rate=${PGSCOPE_BENCH_IDLE_RATE:-100}
backend_counts=(10 100 1000)
started=$SECONDS

scripts/install-deps.sh
cargo build --release --locked -q -p pgscope-agent
pgscope=$PWD/target/release/pgscope
work=$(mktemp -d /tmp/pgscope-bench.XXXXXX)
stats_before=$(sysctl -n kernel.bpf_stats_enabled)
pyroscope_pid='' pgscope_pid='' floor_pid='' holder_pid=
cleanup() {
  local pid
  for pid in "$pgscope_pid" "$floor_pid" "$holder_pid" "$pyroscope_pid"; do
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

clang -g -O2 -target bpf -I"/usr/include/$(gcc -print-multiarch)" -Wall -Werror \
  -c bench/switch_floor/floor.bpf.c -o "$work/floor.bpf.o"
cc -O2 -Wall -Werror bench/switch_floor/floor.c -o "$work/floor" -lbpf

# Where the agent pushes: a real Pyroscope on loopback (scripts/lib/pyroscope.sh; built once when
# the cache has none).
start_bench_pyroscope "$work/pyroscope"
push_to="Pyroscope on 127.0.0.1:$pyroscope_port"

# synchronous_commit=on is the default; said explicitly because the TPC-B figures depend on it.
# Checkpoints are spaced out so that one does not land in some runs and not others.
pgcluster_start -c synchronous_commit=on -c checkpoint_timeout=30min -c max_wal_size=4GB
pgc_pgbench -i -q -s 10 postgres >/dev/null 2>&1
pgc_pgbench -S -c "$clients" -j "$clients" -T 5 postgres >/dev/null 2>&1   # warm the cache
pgc_pgbench -b tpcb-like -c "$clients" -j "$clients" -T 3 postgres >/dev/null 2>&1
cat >"$work/agent.toml" <<EOF
[pyroscope]
url = "$push_url"
[[discovery.include]]
data_dir = "$PGC_DATA"
EOF

# pgbench's TPS with a workload: `select` (-S) or `tpcb` (the TPC-B-like default script).
pgbench_tps() {
  local flags=(-b tpcb-like) out
  [[ $1 == select ]] && flags=(-S)
  out=$(pgc_pgbench "${flags[@]}" -c "$clients" -j "$clients" -T "$secs" postgres 2>"$work/pgbench.err") ||
    { echo "pgbench failed:" >&2; cat "$work/pgbench.err" >&2; exit 1; }
  sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out"
}

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

# Runs pgbench with pgscope (pid $pgscope_pid) attached; prints "tps cpu_s wall_s bpf_stats…".
measured_pgbench() {
  local c0 b0 t0 tps c1 b1 t1
  c0=$(cpu_ticks "$pgscope_pid"); b0=$(bpf_stats "$pgscope_pid"); t0=$EPOCHREALTIME
  tps=$(pgbench_tps "$1")
  t1=$EPOCHREALTIME; c1=$(cpu_ticks "$pgscope_pid"); b1=$(bpf_stats "$pgscope_pid")
  python3 -c '
import os, sys
c0, c1, t0, t1 = map(float, sys.argv[2:6])
b0, b1 = (list(map(int, x.split())) for x in sys.argv[6:8])
print(sys.argv[1], (c1 - c0) / os.sysconf("SC_CLK_TCK"), t1 - t0, *(a - b for a, b in zip(b1, b0)))' \
    "$tps" "$c0" "$c1" "$t0" "$t1" "$b0" "$b1"
}

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
# Waits until the agent has ended its first upload (pushed or not), so that a window of the
# backends' part measures the steady state: the first interval also reads the kernel's symbols
# (/proc/kallsyms, ~40 ms of CPU, then again every 5 minutes: 0.013% of a core), maps and
# symbolizes every backend's binary once and discovers the instance. Its later uploads, one
# every 15 s, fall in the window.
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

# Stops the agent after saving its metrics; sets agent_rss to its peak RSS in KiB.
stop_agent() {
  curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$work/metrics" || : >"$work/metrics"
  sed -n 's/^pgscope_export_pushes_total{result="\([a-z_]*\)"} \([0-9]*\)$/\1 \2/p' "$work/metrics" >>"$work/pushes"
  sed -n 's/^pgscope_samples_dropped_total{reason="\([a-z_]*\)"} \([1-9][0-9]*\)$/\1 \2/p' "$work/metrics" >>"$work/dropped"
  agent_rss=$(awk '/^VmHWM/ {print $2}' "/proc/$pgscope_pid/status" 2>/dev/null || echo 0)
  kill -TERM "$pgscope_pid"
  agent_rss=$(peak_rss_until_exit "$pgscope_pid" "$agent_rss")
  wait "$pgscope_pid" || { echo "the agent failed:" >&2; cat "$work/agent.log" >&2; exit 1; }
  pgscope_pid=
  grep -E ' (WARN|ERROR) ' "$work/agent.log" | sed 's/^[^ ]* *//; s/^/agent: /' >>"$work/notes" || true
}

# One run of one workload under one variant; appends
# "round script variant tps cpu_s wall_s rss_kib bpf_stats…" to $work/runs.
run_variant() {
  local round=$1 script=$2 variant=$3 m rss=0 tps cpu wall bpf
  case $variant in
    base) m="$(pgbench_tps "$script") 0 0 0 0 0 0 0 0 0 0" ;;
    floor)
      "$work/floor" "$work/floor.bpf.o" >"$work/floor.out" 2>&1 &
      floor_pid=$!
      await_line "$work/floor.out" '^attached' "$floor_pid" 10 "the empty sched_switch program did not attach"
      m="$(pgbench_tps "$script") 0 0 0 0 0 0 0 0 0 0"
      kill "$floor_pid"; wait "$floor_pid"; floor_pid= ;;
    trace | exact)
      local mode=(); [[ $variant == exact ]] && mode=(--off-cpu=exact)
      # The trace outlives pgbench by a little so that the whole pgbench run is profiled.
      "$pgscope" trace --instance "$PGC_DATA" --duration "$((secs + 3))s" --top 0 "${mode[@]}" \
        >/dev/null 2>"$work/trace.err" &
      pgscope_pid=$!
      await_line "$work/trace.err" '^pgscope: profiling' "$pgscope_pid" 30 "pgscope trace ${mode[*]} did not start"
      m=$(measured_pgbench "$script")
      rss=$(peak_rss_until_exit "$pgscope_pid")
      wait "$pgscope_pid" || { echo "pgscope trace ${mode[*]} failed:" >&2; cat "$work/trace.err" >&2; exit 1; }
      pgscope_pid=
      # What else it said (e.g. that off-CPU profiling could not start, which would make it
      # pass for a cheap off-CPU profiler) is printed with the results, once per variant.
      grep -Ev '^pgscope: (profiling|instance has [0-9]+ processes)|^\[ *[0-9]+s/' "$work/trace.err" |
        sed "s/^/$variant: /" >>"$work/notes" || true ;;
    agent)
      start_agent
      m=$(measured_pgbench "$script")
      stop_agent
      rss=$agent_rss ;;
  esac
  read -r tps cpu wall bpf <<<"$m"
  echo "$round $script $variant $tps $cpu $wall $rss $bpf" >>"$work/runs"
  echo "round $round, $script, $variant: $tps TPS" >&2
}

variants=(base floor trace exact agent)
: >"$work/runs"; : >"$work/pushes"; : >"$work/dropped"; : >"$work/notes"
for ((r = 1; r <= rounds; r++)); do
  for script in select tpcb; do
    # Rotated from round to round, so that no variant always runs first (after a warm cache, or
    # right after the other workload).
    for ((i = 0; i < ${#variants[@]}; i++)); do
      run_variant "$r" "$script" "${variants[(i + r - 1) % ${#variants[@]}]}"
    done
  done
done

# Backends: max_connections raised (by a restart, so that the pgbench runs above had the
# defaults), then for each count a holder of that many connections and the agent over a window.
max_backends=${backend_counts[-1]}
(($(ulimit -n) > max_backends + 100)) || ulimit -n $((max_backends + 200))
pgc_psql -c "ALTER SYSTEM SET max_connections = $((max_backends + 100))"
pgc_as_pg "$PGC_BINDIR/pg_ctl" -D "$PGC_DATA" -w -l "$PGC_WORK/postgres.log" restart >/dev/null
: >"$work/backends"
for n in "${backend_counts[@]}"; do
  # One process holding n connections (bench/hold_connections.py), SELECT 1 round-robin at
  # $idle_rate per second over all of them, so every backend wakes now and then and nearly all
  # are idle at any instant.
  python3 bench/hold_connections.py "$PGC_WORK/.s.PGSQL.$PGC_PORT" "$n" "$idle_rate" offcpu-bench-idle \
    >"$work/holder.out" 2>&1 &
  holder_pid=$!
  await_line "$work/holder.out" '^held' "$holder_pid" 60 "cannot hold $n connections"
  start_agent --frequency 19
  await_first_push
  c0=$(cpu_ticks "$pgscope_pid"); s0=$(stime_ticks "$pgscope_pid"); b0=$(bpf_stats "$pgscope_pid")
  t0=$EPOCHREALTIME
  sleep "$idle_window"
  t1=$EPOCHREALTIME
  c1=$(cpu_ticks "$pgscope_pid"); s1=$(stime_ticks "$pgscope_pid"); b1=$(bpf_stats "$pgscope_pid")
  backends=$(pgc_psql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")
  stop_agent
  rss=$agent_rss
  kill "$holder_pid"; wait "$holder_pid" 2>/dev/null || true; holder_pid=
  python3 -c '
import os, sys
c0, c1, t0, t1, s0, s1 = map(float, sys.argv[4:8] + sys.argv[10:12])
b0, b1 = (list(map(int, x.split())) for x in sys.argv[8:10])
hz = os.sysconf("SC_CLK_TCK")
print(sys.argv[1], sys.argv[2], sys.argv[3], (c1 - c0) / hz, t1 - t0,
      *(a - b for a, b in zip(b1, b0)), (s1 - s0) / hz)' \
    "$n" "$backends" "$rss" "$c0" "$c1" "$t0" "$t1" "$b0" "$b1" "$s0" "$s1" >>"$work/backends"
  echo "$n backends held: agent measured" >&2
done

python3 - "$work/runs" "$work/backends" "$work/pushes" "$work/dropped" "$work/notes" "$clients" "$secs" "$idle_window" \
  "$idle_rate" "$push_to" "$((SECONDS - started))" <<'PY'
import math, statistics as st, sys
runs_file, backends_file, pushes_file, dropped_file, notes_file = sys.argv[1:6]
clients, secs, window, rate, push_to, elapsed = sys.argv[6:12]
PROGS = ("wait sampler", "on_switch", "on_cpu_sample", "other programs")
runs = []
for line in open(runs_file):
    f = line.split()
    runs.append(dict(round=int(f[0]), script=f[1], variant=f[2], tps=float(f[3]), cpu=float(f[4]),
                     wall=float(f[5]), rss=int(f[6]), bpf=list(map(int, f[7:15]))))

def pick(script, variant):
    return sorted((r for r in runs if r["script"] == script and r["variant"] == variant),
                  key=lambda r: r["round"])

def ratio(script, variant):
    return st.mean(r["tps"] for r in pick(script, variant)) / st.mean(r["tps"] for r in pick(script, "base"))

def bpf_line(rs):
    """Where BPF time goes over these runs: per program, runs/s, ns per run, % of one core."""
    wall = sum(r["wall"] for r in rs)
    parts = []
    for i, name in enumerate(PROGS):
        cnt = sum(r["bpf"][2 * i] for r in rs)
        ns = sum(r["bpf"][2 * i + 1] for r in rs)
        if cnt:
            parts.append(f"{name} {cnt / wall:.0f} runs/s x {ns / cnt:.0f} ns = {100 * ns / 1e9 / wall:.2f}%")
    return ", ".join(parts) or "no BPF program ran"

names = {"select": "pgbench -S", "tpcb": "pgbench TPC-B-like (synchronous_commit=on)"}
labels = {"floor": "empty sched_switch program", "trace": "trace (defaults: on-CPU + sampled off-CPU)",
          "exact": "trace --off-cpu=exact", "agent": "agent (defaults)"}
print(f"{clients} clients, {max(r['round'] for r in runs)} rounds of {secs} s per run, agent pushing to {push_to}")
combined = {}
for script in ("select", "tpcb"):
    base = pick(script, "base")
    print(f"{names[script]}: {st.mean(r['tps'] for r in base):.0f} TPS without pgscope")
    for variant in ("floor", "trace", "exact", "agent"):
        rs = pick(script, variant)
        per_round = " ".join(f"{w['tps'] / b['tps']:.3f}" for w, b in zip(rs, base))
        line = f"  {labels[variant]} / without: {ratio(script, variant):.3f}; per round {per_round}"
        if variant != "floor":
            cpu = 100 * sum(r["cpu"] for r in rs) / sum(r["wall"] for r in rs)
            line += (f"; pgscope {cpu:.2f}% of one core, peak RSS {max(r['rss'] for r in rs) / 1024:.0f} MiB"
                     f"\n    BPF: {bpf_line(rs)}")
        print(line)
        combined.setdefault(variant, []).append(ratio(script, variant))
print("  (the wait sampler runs in pgscope's sampler thread, BPF_PROG_RUN or the iterator's read(): its time is\n"
      "   already in pgscope's CPU;\n"
      "   the others run in the context of the task switched, interrupted or traced: not in it)")

backends = [l.split() for l in open(backends_file)]
cpu_1000 = float("nan")
print(f"agent --frequency 19 with held connections, {rate} SELECT 1/s over them, no pgbench, {window} s each:")
for f in backends:
    n, seen, rss, cpu, wall = int(f[0]), f[1], int(f[2]), float(f[3]), float(f[4])
    bpf, stime = list(map(int, f[5:13])), float(f[13])
    # BPF time outside pgscope's own CPU time (every program but the iterator): charged to the
    # tasks it ran in.
    outside = (bpf[3] + bpf[5] + bpf[7]) / 1e9
    total = 100 * (cpu + outside) / wall
    if n == 1000:
        cpu_1000 = total
    print(f"  {n:4d} backends ({seen} client backends seen): {total:.2f}% of one core "
          f"(process {100 * cpu / wall:.2f}%, of which system {100 * stime / wall:.2f}%, "
          f"+ BPF outside it {100 * outside / wall:.2f}%), "
          f"peak RSS {rss / 1024:.0f} MiB\n    BPF: " + bpf_line([dict(wall=wall, bpf=bpf)]))

pushes = {}
for line in open(pushes_file):
    result, count = line.split()
    pushes[result] = pushes.get(result, 0) + int(count)
dropped = {}
for line in open(dropped_file):
    reason, count = line.split()
    dropped[reason] = dropped.get(reason, 0) + int(count)
print("agent pushes: " + (", ".join(f"{v} {k}" for k, v in sorted(pushes.items())) or "no metrics read")
      + "; samples dropped: " + (", ".join(f"{v} {k}" for k, v in sorted(dropped.items())) or "none"))
notes = list(dict.fromkeys(l.rstrip() for l in open(notes_file) if l.strip()))
if notes:
    print(f"pgscope said ({len(notes)} distinct lines{', the first 20' if len(notes) > 20 else ''}):")
    for line in notes[:20]:
        print("  " + line)
print(f"({int(elapsed) // 60} min {int(elapsed) % 60} s)")
# Each combined ratio is the geometric mean of the two workloads' ratios (mean TPS with / mean
# TPS without, from the same run): each workload weighs the same whatever its TPS.
g = {v: math.sqrt(combined[v][0] * combined[v][1]) for v in ("trace", "agent", "exact")}
print(f"offcpu: trace_ratio={g['trace']:.3f} agent_ratio={g['agent']:.3f} exact_ratio={g['exact']:.3f} "
      f"cpu_pct_1000_backends={cpu_1000:.2f}")
PY
