#!/usr/bin/env bash
# What pgscope gets on the kernel it runs on: run by scripts/test-kernels.sh inside each guest
# (and on the host), as root, from the repository's root.
#
# Usage: scripts/kernel-smoke.sh PGSCOPE RESULT_DIR
# A throwaway distro PostgreSQL 15 cluster under pgbench; on it
#   1. `trace --instance --probes all` (sampled off-CPU): complete stacks, queryids, off-CPU
#      samples, each of the seven probes attached;
#   2. `trace --off-cpu exact` (every context switch traced);
#   3. the agent, pushing once to a Pyroscope on loopback.
# Writes RESULT_DIR/result: one word (ok, refused, failed) and, after it, what each part got;
# the logs of each part beside it. Exits 0 whatever the result: the result is what it reports.
set -uo pipefail

bin=$1
out=$2
mkdir -p "$out"
cd "$(dirname "$0")/.."

# shellcheck source=scripts/lib/free-port.sh
source scripts/lib/free-port.sh
# shellcheck source=scripts/lib/pgcluster.sh
source scripts/lib/pgcluster.sh

result() {
  echo "$*" >"$out/result"
  exit 0
}

# A guest's root has no tracefs mounted (uprobes are created through it).
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true

bench_pid=
pyroscope_pid=
agent_pid=
cleanup() {
  [[ -n $agent_pid ]] && kill "$agent_pid" 2>/dev/null
  [[ -n $bench_pid ]] && kill "$bench_pid" 2>/dev/null
  [[ -n $pyroscope_pid ]] && kill "$pyroscope_pid" 2>/dev/null
  wait 2>/dev/null
  pgcluster_stop
}
trap cleanup EXIT

pgcluster_start -c shared_preload_libraries=pg_stat_statements >"$out/cluster.log" 2>&1 ||
  result failed "cluster: the PostgreSQL 15 cluster did not start (cluster.log)"
pgc_psql -c "CREATE EXTENSION pg_stat_statements" postgres >>"$out/cluster.log" 2>&1
pgc_pgbench -i -q -s 2 postgres >>"$out/cluster.log" 2>&1 || result failed "cluster: pgbench -i failed"
pgc_pgbench -n -c 4 -j 2 -T 3600 postgres >"$out/pgbench.log" 2>&1 &
bench_pid=$!

# 1. The trace, sampled off-CPU, with the seven probes.
"$bin" trace --instance "$PGC_DATA" --duration 10s --probes all --json "$out/trace.json" \
  >"$out/trace.log" 2>&1
trace_rc=$?
if ((trace_rc != 0)); then
  if grep -q "refused pgscope's BPF programs; pgscope needs Linux" "$out/trace.log"; then
    result refused "trace: $(grep -m1 "refused pgscope's BPF programs" "$out/trace.log")"
  fi
  result failed "trace: exit $trace_rc (trace.log)"
fi
trace=$(python3 - "$out/trace.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
problems = []
complete = d["samples"]["user_stacks_complete_pct"]
if complete < 90:
    problems.append(f"user stacks {complete:.1f}% complete")
queryids = [q for q in d["queries"] if q["queryid"] not in ("0", 0)]
if not queryids:
    problems.append("no queryid")
off_cpu = (d.get("off_cpu") or {}).get("total_ns", 0)
if not off_cpu:
    problems.append("no off-CPU time")
seven = {"pgss_store", "s_lock", "LockRelationOid", "GetCachedPlan", "PortalStart", "vac_update_datfrozenxid", "_bt_getroot"}
attached = {p.get("function", "").split("(")[0] for p in d.get("probes", [])}
if seven - attached:
    problems.append("probes not attached: " + ",".join(sorted(seven - attached)))
print(("ok" if not problems else "failed") + f" stacks={complete:.1f}% queryids={len(queryids)} "
      f"off_cpu_ms={off_cpu / 1e6:.0f} probes={len(seven & attached)}/7" + "".join(f"; {p}" for p in problems))
EOF
) || trace="failed the trace's JSON could not be read"

# 2. Every context switch traced.
if "$bin" trace --instance "$PGC_DATA" --duration 3s --off-cpu=exact --json "$out/exact.json" \
  >"$out/exact.log" 2>&1; then
  exact=ok
else
  exact="failed (exact.log)"
fi

# 3. The agent, pushing to a Pyroscope on loopback.
agent="failed"
pyroscope_port=$(free_port 3)
if pyroscope_pid=$(scripts/pyroscope-server.sh start "$pyroscope_port" "$out/pyroscope" 2>"$out/pyroscope-start.log"); then
  metrics_port=$(free_port)
  "$bin" agent --pyroscope-url "http://127.0.0.1:$pyroscope_port" --upload-interval 5s \
    --metrics-addr "127.0.0.1:$metrics_port" >"$out/agent.log" 2>&1 &
  agent_pid=$!
  for _ in $(seq 1 120); do
    accepted=$(curl -s "http://127.0.0.1:$metrics_port/metrics" |
      awk '/^pgscope_export_series_total/ {s += $2} END {print s + 0}')
    if ((accepted > 0)); then
      agent="ok series=$accepted"
      break
    fi
    kill -0 "$agent_pid" 2>/dev/null || { agent="failed (the agent exited: agent.log)"; break; }
    sleep 1
  done
else
  agent="failed (Pyroscope did not start: pyroscope-start.log, pyroscope/pyroscope.log)"
fi

word=ok
for part in "$trace" "$exact" "$agent"; do
  [[ $part == ok* ]] || word=failed
done
result "$word" "trace: $trace | exact: $exact | agent: $agent"
