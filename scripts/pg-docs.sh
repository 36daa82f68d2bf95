#!/usr/bin/env bash
# The PostgreSQL documentation's own descriptions of its wait events, for the majors whose server
# has no pg_wait_events view to read them from (14-16; it came in 17): the wait-event tables of
# doc/src/sgml/monitoring.sgml of PostgreSQL 15, from Debian's source package postgresql-15 (apt
# checks it against the signed archive). scripts/gen-pg-names.py reads it.
#
# Usage: scripts/pg-docs.sh
# Prints `PATH VERSION`: the file, and the Debian source version it came from. Cached under
# $PGSCOPE_CACHE (default /var/cache/pgscope), keyed by that version: a complete entry is reused
# without network. Pinned: a file whose sha256 differs from the one below is refused.
set -euo pipefail

VERSION=15.18-0+deb12u1
SHA256=0ee649fb924b5aa37b802ac6ecb766839a1a547a4e255cc2c644e7031e76ecc5

cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
dir=$cache/pg-docs-$VERSION
file=$dir/monitoring.sgml

die() { echo "pg-docs: $*" >&2; exit 1; }

if [[ -f $file ]] && echo "$SHA256  $file" | sha256sum -c --status; then
  echo "$file $VERSION"
  exit 0
fi

# shellcheck source=scripts/lib/deb-src.sh
source "$(dirname "$0")/lib/deb-src.sh"
ensure_deb_src
mkdir -p "$cache"
work=$(mktemp -d "$cache/.pg-docs.XXXXXX")
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get source --download-only -qq "postgresql-15=$VERSION" >/dev/null 2>fetch.err) ||
  die "cannot fetch Debian's source of postgresql-15=$VERSION: $(grep -m1 '^E:' "$work/fetch.err" || true)"
tar -xjf "$work"/postgresql-15_*.orig.tar.bz2 -C "$work" --wildcards '*/doc/src/sgml/monitoring.sgml' ||
  die "the source of postgresql-15=$VERSION has no doc/src/sgml/monitoring.sgml"
mkdir -p "$work/entry"
mv "$work"/postgresql-15*/doc/src/sgml/monitoring.sgml "$work/entry/monitoring.sgml"
echo "$SHA256  $work/entry/monitoring.sgml" | sha256sum -c --status ||
  die "monitoring.sgml of postgresql-15=$VERSION is not the pinned one (sha256 $SHA256)"
rm -rf "$dir"
mv "$work/entry" "$dir"
echo "$file $VERSION"
