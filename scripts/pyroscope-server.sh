#!/usr/bin/env bash
# A real Grafana Pyroscope server for the end-to-end tests, built from the Go module proxy, with
# its web UI (what operators look at our profiles in).
#
#   scripts/pyroscope-server.sh build            builds once into $PGSCOPE_CACHE, prints the binary
#   scripts/pyroscope-server.sh start PORT DIR   starts it (HTTP on PORT, gRPC PORT+1, gossip
#                                                PORT+2, all data under DIR), waits until ready,
#                                                prints its PID
#
# Why the detour: `github.com/grafana/pyroscope` v1.12.0 replaces its `api` module with the
# `./api` folder, which the module zip leaves out (it is a module of its own), and the proxy has
# no api version tagged for that commit. The api module's v1.1.0 (2025-01-08, a week before
# v1.12.0) carries the same generated push/querier types: the server builds and answers with it.
#
# The UI: the module's source holds the frontend (public/app, package.json, yarn.lock); built
# with yarn into public/build and compiled in with the `embedassets` tag, the server serves it
# (without, it answers "not available in dev mode"). Two changes to the build copy: yarn.lock's
# URLs point at the npm registry this machine reaches (the integrity hashes stay and are
# checked), and `@grafana/flamegraph` is pinned to 11.3.1, because 11.4.0, which v1.12.0 pins, is
# no longer published (yarn resolves 11.3.1 and its @grafana dependencies afresh). `canvas`, a
# native module only the frontend's unit tests use, is left out: it does not build here.
set -euo pipefail

PYROSCOPE_VERSION=v1.12.0
API_VERSION=v1.1.0
FLAMEGRAPH_VERSION=11.3.1
YARN_VERSION=1.22.22
cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
bin_dir="$cache/pyroscope-$PYROSCOPE_VERSION-api-$API_VERSION-ui-flamegraph-$FLAMEGRAPH_VERSION"
bin="$bin_dir/pyroscope"

# public/build of the source copy in SRC, built with yarn (its cache in the scratch copy too:
# ~2 GB that a later build would not need, since the result is cached).
build_ui() {
  local src=$1 yarn_dir="$cache/yarn-$YARN_VERSION" registry
  command -v npm >/dev/null || { echo "pyroscope-server.sh: npm is not installed (scripts/install-deps.sh installs it)" >&2; exit 1; }
  [[ -x $yarn_dir/node_modules/.bin/yarn ]] || npm install --silent --prefix "$yarn_dir" "yarn@$YARN_VERSION" >&2
  registry=$(npm config get registry)
  sed -i "s#https://registry.yarnpkg.com/#${registry%/}/#" "$src/yarn.lock"
  sed -i "s#\"@grafana/flamegraph\": \"[^\"]*\"#\"@grafana/flamegraph\": \"$FLAMEGRAPH_VERSION\"#; /\"canvas\": /d" \
    "$src/package.json"
  (
    cd "$src"
    export CYPRESS_INSTALL_BINARY=0 YARN_CACHE_FOLDER="$src/.yarn-cache"
    nice "$yarn_dir/node_modules/.bin/yarn" install --ignore-engines --non-interactive --network-timeout 600000
    # `yarn build` without its --progress (hundreds of lines in the CI log).
    NODE_ENV=production nice "$yarn_dir/node_modules/.bin/yarn" run webpack --config scripts/webpack/webpack.prod.js
  ) >&2
  [[ -f $src/public/build/index.html ]] || { echo "pyroscope-server.sh: the UI build made no public/build/index.html" >&2; exit 1; }
}

build() {
  if [[ -x $bin ]]; then
    echo "$bin"
    return
  fi
  command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
  command -v go >/dev/null || { echo "pyroscope-server.sh: Go is not installed (scripts/install-deps.sh installs it)" >&2; exit 1; }
  # Modules and the build cache live in the cache directory: the next CI run reuses them.
  export GOPATH="$cache/go" GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build-cache"
  export GOFLAGS=-mod=mod GOWORK=off GOTOOLCHAIN=local
  local src; src=$(mktemp -d /tmp/pyroscope-src.XXXXXX)
  trap 'rm -rf "$src"' RETURN
  local module
  module=$(go mod download -json "github.com/grafana/pyroscope@$PYROSCOPE_VERSION" |
    sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  cp -r "$module/." "$src/"
  chmod -R u+w "$src"
  rm -f "$src/go.work" "$src/go.work.sum"
  sed -i "s#github.com/grafana/pyroscope/api => ./api#github.com/grafana/pyroscope/api => github.com/grafana/pyroscope/api $API_VERSION#" "$src/go.mod"
  build_ui "$src"
  mkdir -p "$bin_dir"
  (cd "$src" && nice go build -tags embedassets -o "$bin.tmp" ./cmd/pyroscope) >&2
  mv "$bin.tmp" "$bin"
  echo "$bin"
}

start() {
  local port=$1 dir=$2
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  build >/dev/null
  # A server already on the port would answer /ready and pass for this one.
  if curl -s -o /dev/null "http://127.0.0.1:$port/ready"; then
    echo "pyroscope-server.sh: port $port is already in use" >&2
    exit 1
  fi
  # Single binary (-target=all), filesystem storage, nothing sent anywhere (no usage stats, no
  # self-profiling pushes). Every listen, ring and gossip address is loopback: left unset, the
  # rings advertise the host's interface address. Every data directory is under DIR, and the
  # server runs in DIR, so that a default relative path (./data…) cannot land elsewhere.
  local ring_addrs=() ring
  for ring in compactor.ring distributor.ring overrides-exporter.ring query-scheduler.ring \
    store-gateway.sharding-ring; do
    ring_addrs+=("-$ring.instance-addr=127.0.0.1")
  done
  (cd "$dir" && exec "$bin" -target=all \
    -server.http-listen-address=127.0.0.1 -server.http-listen-port="$port" \
    -server.grpc-listen-address=127.0.0.1 -server.grpc-listen-port="$((port + 1))" \
    -memberlist.bind-addr=127.0.0.1 -memberlist.advertise-addr=127.0.0.1 \
    -memberlist.bind-port="$((port + 2))" -memberlist.advertise-port="$((port + 2))" \
    -ingester.lifecycler.addr=127.0.0.1 -query-frontend.instance-addr=127.0.0.1 \
    "${ring_addrs[@]}" \
    -storage.backend=filesystem -storage.filesystem.dir="$dir/store" \
    -pyroscopedb.data-path="$dir/data" -compactor.data-dir="$dir/data-compactor" \
    -blocks-storage.bucket-store.sync-dir="$dir/sync" \
    -embedded-grafana.data-path="$dir/grafana" \
    -usage-stats.enabled=false -self-profiling.disable-push=true \
    -ingester.min-ready-duration=0s \
    >"$dir/pyroscope.log" 2>&1) &
  local pid=$!
  # Ready within a few seconds (the ingester's 15 s settling time is for rings of many).
  for _ in $(seq 120); do
    if [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/ready") == 200 ]]; then
      echo "$pid"
      return
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  echo "pyroscope-server.sh: Pyroscope did not become ready on port $port:" >&2
  tail -20 "$dir/pyroscope.log" >&2
  kill "$pid" 2>/dev/null || true
  exit 1
}

case ${1:-} in
  build) build ;;
  start) start "${2:?PORT}" "${3:?DIR}" ;;
  *) echo "usage: $0 build | start PORT DIR" >&2; exit 2 ;;
esac
