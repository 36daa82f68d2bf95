#!/usr/bin/env bash
# A real Kubernetes control plane for the tests: etcd and kube-apiserver, built from the Go module
# proxy (cached in $PGSCOPE_CACHE, keyed by version) and started on loopback with their data in a
# directory of the caller's. No kubelet, scheduler or controller manager: the tests need the API
# server's storage, watch, field selectors, authentication (ServiceAccount tokens through the
# TokenRequest API), the RBAC authorizer and admission, which it has on its own.
#
# Usage:
#   scripts/kube-control-plane.sh build        builds (once) and prints the directory of the binaries
#   scripts/kube-control-plane.sh start DIR    starts etcd and the API server with their state in DIR;
#                                              prints the API server's URL once it is ready
#   scripts/kube-control-plane.sh stop-apiserver DIR
#                                              stops the API server only (etcd keeps the state)
#   scripts/kube-control-plane.sh start-apiserver DIR
#                                              starts it again on the same port; prints its URL
#                                              once it is ready (an API server restart, an outage)
#   scripts/kube-control-plane.sh stop DIR     stops what `start DIR` started
#
# `start` writes into DIR: ca.crt (the API server's CA), admin.token (a static token of a
# system:masters user, for the test's own requests), admin.kubeconfig (the same for helm),
# audit.log (every request, with its user and URL: what a field selector asked for), pids, and
# the servers' logs. The API server listens on 127.0.0.1 only and advertises 127.0.0.1; etcd too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/free-port.sh

KUBERNETES_VERSION=v1.31.4
# The staging modules (k8s.io/api, client-go, …) are published as v0.<minor>.<patch>.
STAGING_VERSION=v0.31.4
ETCD_VERSION=v3.5.17
cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
bin_dir="$cache/kube-$KUBERNETES_VERSION-etcd-$ETCD_VERSION"

go_env() {
  command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
  command -v go >/dev/null || { echo "kube-control-plane.sh: Go is not installed (scripts/install-deps.sh says how)" >&2; exit 1; }
  export GOPATH="$cache/go" GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build-cache"
  export GOFLAGS=-mod=mod GOWORK=off GOTOOLCHAIN=local
}

# k8s.io/kubernetes replaces its staging modules with ./staging/… in its own go.mod, which Go
# ignores in a dependency: a wrapper module pins it and replaces each with its published version.
build_apiserver() {
  local scratch=$1 kube_mod
  kube_mod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')
  mkdir -p "$scratch/apiserver"
  {
    printf 'module pgscope-kube-apiserver\n\ngo 1.22.0\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$KUBERNETES_VERSION"
    sed -n "s#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*#\t\1 => \1 $STAGING_VERSION#p" "$kube_mod"
    printf ')\n'
  } >"$scratch/apiserver/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kube-apiserver"\n' \
    >"$scratch/apiserver/tools.go"
  (cd "$scratch/apiserver" && go mod tidy && nice go build \
    -ldflags "-X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION $(version_ldflags)" \
    -o "$bin_dir/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver)
  mv "$bin_dir/kube-apiserver.tmp" "$bin_dir/kube-apiserver"
}

# /version answers what a release build would (helm and clients read it), not v0.0.0-master.
version_ldflags() {
  local major minor
  IFS=. read -r major minor _ <<<"${KUBERNETES_VERSION#v}"
  printf -- '-X k8s.io/component-base/version.gitMajor=%s -X k8s.io/component-base/version.gitMinor=%s' \
    "$major" "$minor"
}

build_etcd() {
  local scratch=$1
  mkdir -p "$scratch/etcd"
  (
    cd "$scratch/etcd"
    go mod init pgscope-etcd >/dev/null 2>&1
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    nice go build -o "$bin_dir/etcd.tmp" go.etcd.io/etcd/server/v3
  )
  mv "$bin_dir/etcd.tmp" "$bin_dir/etcd"
}

build() {
  if [[ -x $bin_dir/kube-apiserver && -x $bin_dir/etcd ]]; then
    echo "$bin_dir"
    return
  fi
  go_env
  mkdir -p "$bin_dir"
  local scratch; scratch=$(mktemp -d /tmp/kube-build.XXXXXX)
  trap 'rm -rf "$scratch"' RETURN
  [[ -x $bin_dir/etcd ]] || build_etcd "$scratch" >&2
  [[ -x $bin_dir/kube-apiserver ]] || build_apiserver "$scratch" >&2
  echo "$bin_dir"
}

# A CA, the API server's serving certificate for 127.0.0.1 and the service accounts' signing key.
make_pki() {
  local dir=$1
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=pgscope-test-ca" \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$dir/apiserver.key" -out "$dir/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n' >"$dir/apiserver.ext"
  openssl x509 -req -in "$dir/apiserver.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 2 -extfile "$dir/apiserver.ext" -out "$dir/apiserver.crt" 2>/dev/null
  openssl genrsa -out "$dir/sa.key" 2048 2>/dev/null
  openssl rsa -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null
}

# Every request, at the Metadata level: user, verb and URL (with its query: the field selector).
audit_policy() {
  printf 'apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n- level: Metadata\n'
}

start() {
  local dir=$1
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  build >/dev/null
  make_pki "$dir"
  local admin_token
  admin_token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
  printf '%s\n' "$admin_token" >"$dir/admin.token"
  printf '%s,pgscope-test-admin,pgscope-test-admin,system:masters\n' "$admin_token" >"$dir/tokens.csv"
  chmod 600 "$dir/admin.token" "$dir/tokens.csv"
  audit_policy >"$dir/audit-policy.yaml"

  local etcd_port peer_port api_port
  etcd_port=$(free_port 3)
  peer_port=$((etcd_port + 1))
  api_port=$((etcd_port + 2))
  "$bin_dir/etcd" --name pgscope-test --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "pgscope-test=http://127.0.0.1:$peer_port" \
    --listen-metrics-urls "" >"$dir/etcd.log" 2>&1 &
  echo "$!" >"$dir/pids"
  printf '%s %s\n' "$etcd_port" "$api_port" >"$dir/ports"
  start_apiserver "$dir" "$etcd_port" "$api_port"
  write_kubeconfig "$dir" "$api_port" "$admin_token"
  echo "https://127.0.0.1:$api_port"
}

# The API server on etcd at ETCD_PORT, serving on API_PORT; returns once it is ready. On SIGTERM
# it drains open watches for 2 s, then ends them (left unset, they hold its shutdown for 60 s:
# the request timeout), as a restart does to every client's watch.
start_apiserver() {
  local dir=$1 etcd_port=$2 api_port=$3
  "$bin_dir/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" \
    --tls-cert-file "$dir/apiserver.crt" --tls-private-key-file "$dir/apiserver.key" \
    --client-ca-file "$dir/ca.crt" --token-auth-file "$dir/tokens.csv" \
    --service-account-key-file "$dir/sa.pub" --service-account-signing-key-file "$dir/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --api-audiences https://kubernetes.default.svc.cluster.local \
    --authorization-mode Node,RBAC --anonymous-auth=false \
    --service-cluster-ip-range 10.96.0.0/24 \
    --audit-policy-file "$dir/audit-policy.yaml" --audit-log-path "$dir/audit.log" \
    --shutdown-watch-termination-grace-period 2s \
    --cert-dir "$dir/apiserver-certs" >"$dir/apiserver.log" 2>&1 &
  echo "$!" >>"$dir/pids"
  local token; token=$(cat "$dir/admin.token")
  for _ in $(seq 600); do
    if curl -sf --cacert "$dir/ca.crt" -H "Authorization: Bearer $token" \
      "https://127.0.0.1:$api_port/readyz" >/dev/null 2>&1; then
      return
    fi
    kill -0 "$(tail -1 "$dir/pids")" 2>/dev/null || break
    sleep 0.1
  done
  echo "kube-control-plane.sh: the API server did not become ready; its log:" >&2
  tail -30 "$dir/apiserver.log" >&2
  stop "$dir"
  exit 1
}

write_kubeconfig() {
  local dir=$1 api_port=$2 token=$3
  cat >"$dir/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: pgscope-test
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $dir/ca.crt
users:
- name: pgscope-test-admin
  user:
    token: $token
contexts:
- name: pgscope-test
  context:
    cluster: pgscope-test
    user: pgscope-test-admin
current-context: pgscope-test
EOF
  chmod 600 "$dir/admin.kubeconfig"
}

# The pids file holds etcd's PID, then the API server's (when it runs).
stop_apiserver() {
  local dir=$1 etcd pid
  { read -r etcd; read -r pid || true; } <"$dir/pids"
  if [[ -n ${pid:-} ]]; then
    kill "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
  echo "$etcd" >"$dir/pids"
}

restart_apiserver() {
  local dir=$1 etcd_port api_port
  read -r etcd_port api_port <"$dir/ports"
  [[ $(wc -l <"$dir/pids") == 1 ]] || { echo "kube-control-plane.sh: the API server of $dir runs" >&2; exit 1; }
  start_apiserver "$dir" "$etcd_port" "$api_port"
  echo "https://127.0.0.1:$api_port"
}

stop() {
  local dir=$1 pid
  [[ -f $dir/pids ]] || return 0
  # The API server first (the last pid), then etcd.
  while read -r pid; do
    kill "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  done < <(tac "$dir/pids")
  rm -f "$dir/pids"
}

case ${1:-} in
  build) build ;;
  start) start "${2:?usage: start DIR}" ;;
  stop-apiserver) stop_apiserver "${2:?usage: stop-apiserver DIR}" ;;
  start-apiserver) restart_apiserver "${2:?usage: start-apiserver DIR}" ;;
  stop) stop "${2:?usage: stop DIR}" ;;
  *) echo "usage: $0 build | start DIR | stop-apiserver DIR | start-apiserver DIR | stop DIR" >&2; exit 2 ;;
esac
