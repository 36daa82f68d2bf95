# shellcheck shell=bash
# For the benchmarks (sourced, not run): the real Pyroscope they push to, the one
# scripts/pyroscope-server.sh builds (that script alone knows its binary's path; on an empty
# cache `build` builds it, a few minutes once).

# Starts a Pyroscope on three free loopback ports with its data under DIR ($1); sets
# pyroscope_pid, pyroscope_port and push_url. A benchmark that pushes nowhere measures a refused
# connection instead of an upload: when the server cannot be built or started, this says why and
# exits.
# shellcheck disable=SC2034 # pyroscope_pid and push_url are the caller's
start_bench_pyroscope() {
  local dir=$1 bin
  if ! bin=$(scripts/pyroscope-server.sh build); then
    echo "${0##*/}: cannot build the Pyroscope server (scripts/pyroscope-server.sh build failed above); the benchmark needs one to push to" >&2
    exit 1
  fi
  pyroscope_port=$(free_port 3)
  if ! pyroscope_pid=$(scripts/pyroscope-server.sh start "$pyroscope_port" "$dir"); then
    echo "${0##*/}: Pyroscope ($bin) did not start on 127.0.0.1:$pyroscope_port (its log is above); the benchmark needs it" >&2
    pyroscope_pid=
    exit 1
  fi
  push_url=http://127.0.0.1:$pyroscope_port
}
