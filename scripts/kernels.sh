#!/usr/bin/env bash
# The kernels `make test-kernels` boots: Debian's generic amd64 kernel of each suite (bullseye's
# 5.10, bookworm's 6.1, trixie's 6.12), the newest build of that series the mirror serves, and
# virtme-ng (PyPI) with qemu (Debian) to boot them sharing the host's root.
#
# Usage: scripts/kernels.sh
# Prints `vng PATH`, then one line per kernel, `SERIES RELEASE VMLINUZ`, e.g.
# `6.1 6.1.0-57-amd64 /var/cache/pgscope/kernels/6.1.0-57-amd64/vmlinuz`. Each is cached under
# $PGSCOPE_CACHE (default /var/cache/pgscope)/kernels by release: a complete entry is reused
# without network. Its modules are installed where the guest looks for them, /lib/modules/RELEASE
# (the guest's root is the host's). The packages are Debian's, checked by apt against the signed
# archive; only the series is pinned, as the mirror serves the newest build of each alone.
set -euo pipefail

# series  suite  the package name's pattern (a grep -E of the whole name)
SERIES=(
  "5.10 bullseye ^linux-image-5\.10\.0-[0-9]+-amd64-unsigned$"
  "6.1 bookworm ^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$"
  "6.12 trixie ^linux-image-6\.12\.[0-9]+\+deb13-amd64-unsigned$"
)
VIRTME_NG=1.42

cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
root=$cache/kernels

log() { echo "kernels: $*" >&2; }
die() { echo "kernels: $*" >&2; exit 1; }

# apt-get with the lists of one suite in $root/apt/SUITE, leaving the machine's own alone.
suite_apt() {
  local suite=$1 dir=$root/apt/$1
  shift
  "$@" -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=- \
    -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" -o Dir::State::status=/dev/null
}

suite_lists() {
  local suite=$1 dir=$root/apt/$1
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  cat >"$dir/sources.list" <<EOF
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security $suite-security main
EOF
  suite_apt "$suite" apt-get update -qq >/dev/null || die "cannot read the package lists of $suite"
}

# The tools: qemu and what virtme-ng needs from Debian, virtme-ng in a venv of its own.
tools() {
  local missing=()
  command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
  command -v busybox >/dev/null || missing+=(busybox-static)
  command -v depmod >/dev/null || missing+=(kmod)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null ||
      die "cannot install ${missing[*]}"
  fi
  local venv=$cache/virtme-ng-$VIRTME_NG
  if [[ ! -f $venv/.complete ]]; then
    log "installing virtme-ng $VIRTME_NG"
    rm -rf "$venv"
    # The venv's scripts name their interpreter by its path: it is built where it stays.
    { python3 -m venv "$venv" && "$venv/bin/pip" install -q "virtme-ng==$VIRTME_NG"; } ||
      { rm -rf "$venv"; die "cannot install virtme-ng $VIRTME_NG from PyPI"; }
    touch "$venv/.complete"
  fi
  echo "vng $venv/bin/vng"
}

# Fetches (once) the kernel of a series; prints its line.
kernel() {
  local series=$1 suite=$2 pattern=$3 pkg release entry work
  if [[ ! -d $root/apt/$suite/lists ]] || [[ -z $(find "$root/apt/$suite/lists" -maxdepth 1 -name '*Packages*' -mmin -1440) ]]; then
    suite_lists "$suite"
  fi
  pkg=$(suite_apt "$suite" apt-cache pkgnames linux-image- | grep -E "$pattern" | sort -V | tail -n 1) ||
    die "$suite serves no package matching $pattern"
  release=${pkg#linux-image-}
  release=${release%-unsigned}
  entry=$root/$release
  if [[ ! -f $entry/.complete ]]; then
    log "fetching $pkg ($suite)"
    work=$(mktemp -d "$root/.fetch.XXXXXX")
    (cd "$work" && suite_apt "$suite" apt-get download -qq "$pkg" >/dev/null 2>fetch.err) ||
      { rm -rf "$work"; die "cannot download $pkg: $(grep -m1 '^E:' "$work/fetch.err" 2>/dev/null || true)"; }
    dpkg-deb -x "$work"/linux-image-*.deb "$work/x"
    mkdir -p "$work/entry"
    mv "$work/x/boot/vmlinuz-$release" "$work/entry/vmlinuz"
    local modules=$work/x/lib/modules/$release
    [[ -d $modules ]] || modules=$work/x/usr/lib/modules/$release
    [[ -d $modules ]] || die "$pkg holds no modules for $release"
    mv "$modules" "$work/entry/modules"
    touch "$work/entry/.complete"
    rm -rf "$entry"
    mv "$work/entry" "$entry"
    rm -rf "$work"
  fi
  # The guest loads virtio and 9p from the host's /lib/modules.
  if [[ ! -e /lib/modules/$release/modules.dep ]]; then
    mkdir -p /lib/modules
    rm -rf "/lib/modules/$release"
    cp -a "$entry/modules" "/lib/modules/$release"
    depmod "$release"
  fi
  echo "$series $release $entry/vmlinuz"
}

mkdir -p "$root"
tools
for line in "${SERIES[@]}"; do
  # shellcheck disable=SC2086 # three words
  kernel $line
done
