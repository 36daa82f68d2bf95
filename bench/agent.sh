#!/usr/bin/env bash
# What `pgscope agent` at its default settings costs a busy Postgres, measured side by side in
# one run on one cluster:
#   1. pgbench -S TPS with the agent running vs without it, interleaved rounds;
#   2. the agent's CPU (% of one CPU) and peak RSS over a long pgbench -S run;
#   3. the same under connection churn (pgbench -C: a new backend per transaction).
# Profiles go to a local sink that accepts every push (what Pyroscope's ingestion costs is
# Pyroscope's, not the agent's). A benchmark, not a test: it asserts nothing.
#
# Usage: bench/agent.sh [ROUNDS] [SECONDS_PER_ROUND] [LONG_RUN_SECONDS]   (needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/pgcluster.sh

rounds=${1:-3}
secs=${2:-30}
long=${3:-300}
clients=${PGSCOPE_BENCH_CLIENTS:-2}

scripts/install-deps.sh
cargo build --release --locked -q -p pgscope-agent
pgscope=$PWD/target/release/pgscope
work=$(mktemp -d /tmp/pgscope-bench.XXXXXX)
sink_pid=
agent_pid=
cleanup() {
  [[ -n $agent_pid ]] && kill "$agent_pid" 2>/dev/null || true
  [[ -n $sink_pid ]] && kill "$sink_pid" 2>/dev/null || true
  pgcluster_stop
  rm -rf "$work"
}
trap cleanup EXIT

pgcluster_start
pgc_pgbench -i -q -s 10 postgres >/dev/null 2>&1
pgc_pgbench -S -c "$clients" -j "$clients" -T 5 postgres >/dev/null 2>&1   # warm the cache

# A push sink: answers 200 to everything, counts what it got.
sink_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 - "$sink_port" >"$work/sink.log" 2>&1 <<'PY' &
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
PY
sink_pid=$!
cat >"$work/agent.toml" <<EOF
[pyroscope]
url = "http://127.0.0.1:$sink_port"
[[discovery.include]]
data_dir = "$PGC_DATA"
EOF

metrics_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start_agent() {
  "$pgscope" agent --config "$work/agent.toml" --metrics-addr "127.0.0.1:$metrics_port" 2>"$work/agent.log" &
  agent_pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$metrics_port/readyz" >/dev/null 2>&1 && return
    sleep 0.1
  done
  cat "$work/agent.log" >&2; exit 1
}
stop_agent() {
  kill -TERM "$agent_pid"; wait "$agent_pid" || { cat "$work/agent.log" >&2; exit 1; }
  agent_pid=
}
# utime + stime of the agent, in clock ticks.
agent_ticks() { awk '{print $14 + $15}' "/proc/$agent_pid/stat"; }
agent_peak_rss_kib() { awk '/^VmHWM/ {print $2}' "/proc/$agent_pid/status"; }

run_pgbench() {
  pgc_pgbench -S -c "$clients" -j "$clients" -T "$1" "${@:2}" postgres 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}

declare -a base with
for ((r = 1; r <= rounds; r++)); do
  base+=("$(run_pgbench "$secs")")
  start_agent
  with+=("$(run_pgbench "$secs")")
  stop_agent
  echo "round $r: tps without agent ${base[-1]}, with agent ${with[-1]}" >&2
done

# Agent CPU and peak RSS over a long run: "cpu_pct peak_mib tps".
long_run() {
  start_agent
  local t0; t0=$(agent_ticks)
  local tps; tps=$(run_pgbench "$long" "$@")
  local t1; t1=$(agent_ticks)
  local peak; peak=$(agent_peak_rss_kib)
  local pushes; pushes=$(curl -s "http://127.0.0.1:$metrics_port/metrics" | sed -n 's/^pgscope_export_pushes_total{result="ok"} //p')
  stop_agent
  python3 -c 'import os, sys; t0, t1, secs, peak = map(float, sys.argv[1:5]); hz = os.sysconf("SC_CLK_TCK"); print(f"{100 * (t1 - t0) / hz / secs:.2f} {peak / 1024:.1f} {sys.argv[5]} {sys.argv[6]}")' \
    "$t0" "$t1" "$long" "$peak" "$tps" "$pushes"
}
read -r cpu rss tps pushes < <(long_run)
read -r churn_cpu churn_rss churn_tps churn_pushes < <(long_run -C)

python3 - "$clients" "${base[*]}" "${with[*]}" <<PY
import statistics as st, sys
clients = sys.argv[1]
base, with_ = ([float(x) for x in a.split()] for a in sys.argv[2:4])
print(f"pgbench -S, {clients} clients, {len(base)} rounds of ${secs} s: {st.mean(base):.0f} TPS without the agent")
print(f"with agent / without: {st.mean(with_) / st.mean(base):.3f}; per round "
      + " ".join(f"{w / b:.3f}" for w, b in zip(with_, base)))
print(f"agent over ${long} s of pgbench -S ($tps TPS): {float('$cpu'):.2f}% of one CPU, peak RSS $rss MiB, $pushes pushes")
print(f"agent over ${long} s of pgbench -S -C ($churn_tps TPS, a backend per transaction): "
      f"{float('$churn_cpu'):.2f}% of one CPU, peak RSS $churn_rss MiB, $churn_pushes pushes")
PY
