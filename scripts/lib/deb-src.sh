# shellcheck shell=bash
# Sourced by scripts that fetch Debian source packages: `apt-get source` needs a deb-src entry
# for the suite the machine's packages come from (bookworm). ensure_deb_src adds one, once.

ensure_deb_src() {
  if grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ || grep -qs '^deb-src' /etc/apt/sources.list; then
    return 0
  fi
  echo "$(basename "$0"): adding deb-src entries for bookworm" >&2
  cat > /etc/apt/sources.list.d/pgscope-deb-src.sources <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt-get update -qq
}
