#!/usr/bin/env bash
# Build PostgreSQL 15 the way RHEL-family distros do: -O2 -g without frame pointers, binaries
# stripped, debug info moved to a separate build-id tree. Tests use it as "a Postgres without
# frame pointers and with separate debug files". The source is Debian's own source package of the
# installed postgresql-15, so the code matches the distro build line for line.
#
# Usage: scripts/build-postgres-nofp.sh [PREFIX]
# The result is cached: a second run with the same installed version does nothing.
set -euo pipefail

version=$(dpkg-query -W -f='${Version}' postgresql-15 2>/dev/null) || {
  echo "postgresql-15 is not installed; run 'make deps' first" >&2; exit 1; }
cache_root=${PGSCOPE_CACHE:-/var/cache/pgscope}
# Debian's source patches pkglibdir to /usr/lib/postgresql/15/lib unless the library path
# contains "pgsql" or "postgres": the prefix must, or `make install` overwrites the distro's
# extension libraries (checked after the install below).
prefix=${1:-$cache_root/pgsql-15-nofp-$version}
if [[ -f $prefix/.complete ]]; then
  echo "$prefix"
  exit 0
fi

log() { echo "build-postgres-nofp: $*" >&2; }

# apt-get source needs a deb-src entry for the suite the binary came from.
# shellcheck source=scripts/lib/deb-src.sh
source "$(dirname "$0")/lib/deb-src.sh"
ensure_deb_src
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev build-essential bison flex \
  zlib1g-dev libssl-dev binutils >/dev/null

work=$(mktemp -d "${TMPDIR:-/tmp}/pgscope-pgbuild.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
# The installed version's source first; registry mirrors do not always carry the security
# pocket's sources, so fall back to the other published 15.x sources, newest first.
fetched=""
for v in "$version" $(apt-cache showsrc postgresql-15 | sed -n 's/^Version: //p' | sort -rV); do
  log "fetching source of postgresql-15=$v"
  if apt-get source -qq "postgresql-15=$v" >/dev/null 2>fetch.err; then fetched=$v; break; fi
  log "source $v not available: $(grep -m1 '^E:' fetch.err || true)"
  rm -rf ./postgresql-15*
done
[[ -n $fetched ]] || { echo "no postgresql-15 source package could be fetched; check deb-src entries" >&2; exit 1; }
[[ $fetched == "$version" ]] || log "building $fetched instead of installed $version (same major)"
src=$(find . -maxdepth 1 -type d -name 'postgresql-15*' | head -n 1)
cd "$src"

# Run from `make pg-nofp`, the outer make's MAKELEVEL would reach Postgres' build, which
# generates its headers (utils/errcodes.h, …) only in a top-level make (MAKELEVEL 0): the
# build then fails on a machine without the cache.
unset MAKELEVEL MAKEFLAGS MFLAGS
log "configuring (CFLAGS=-O2 -g -fomit-frame-pointer) into $prefix"
./configure --prefix="$prefix" --without-readline --without-icu --with-openssl \
  CFLAGS="-O2 -g -fomit-frame-pointer" >configure.log 2>&1 || { tail -30 configure.log >&2; exit 1; }
log "building with $(nproc) jobs"
make -s -j"$(nproc)" >make.log 2>&1 || { tail -30 make.log >&2; exit 1; }
make -s -C contrib/pg_stat_statements -j"$(nproc)" >>make.log 2>&1
rm -rf "$prefix"
# The server loads extensions from the PKGLIBDIR compiled in: it must lie inside the prefix.
pkglibdir=$(sed -n 's/^#define PKGLIBDIR "\(.*\)"$/\1/p' src/port/pg_config_paths.h)
if [[ $pkglibdir != "$prefix"/* ]]; then
  echo "build-postgres-nofp: refusing to install: pkglibdir is '$pkglibdir', outside $prefix" \
    "(Debian's per-version-dirs patch); choose a prefix whose path contains 'pgsql'" >&2
  exit 1
fi
make -s install >>make.log 2>&1
make -s -C contrib/pg_stat_statements install >>make.log 2>&1

# Split debug info the way distros do: <prefix>/debug/.build-id/xx/rest.debug, binaries stripped
# of .symtab and DWARF (the dynamic symbol table stays) and pointing at it with .gnu_debuglink.
log "splitting debug info into $prefix/debug/.build-id"
while IFS= read -r -d '' f; do
  file -b "$f" | grep -q '^ELF' || continue
  id=$(readelf -n "$f" | sed -n 's/^ *Build ID: *//p' | head -n 1)
  [[ -n $id ]] || continue
  dbg="$prefix/debug/.build-id/${id:0:2}/${id:2}.debug"
  mkdir -p "$(dirname "$dbg")"
  objcopy --only-keep-debug "$f" "$dbg"
  chmod 0644 "$dbg"
  objcopy --strip-all --remove-section=.comment "$f"
  objcopy --add-gnu-debuglink="$dbg" "$f"
done < <(find "$prefix/bin" "$prefix/lib" -type f -print0)

touch "$prefix/.complete"
log "done: $prefix"
echo "$prefix"
