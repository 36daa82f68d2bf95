#!/usr/bin/env bash
# The binary a node pulls, without the debug info it does not run: `make release` builds with
# `debug = 1` (file and line in panics' backtraces), which is most of the file. This writes
# OUT/pgscope, without its DWARF sections (its symbol table stays, so a backtrace names
# functions even without the debug file), and OUT/pgscope.debug, the DWARF alone. The binary's
# `.gnu_debuglink` names the debug file: gdb, addr2line and the Rust runtime's backtraces find it
# beside the binary, in `.debug/` there, or under /usr/lib/debug (where the image's `debug`
# stage puts it).
#
# Usage: scripts/split-debug.sh BINARY OUT_DIR
# Prints the sizes, in MiB, of the three files.
set -euo pipefail

binary=${1:?usage: scripts/split-debug.sh BINARY OUT_DIR}
out=${2:?usage: scripts/split-debug.sh BINARY OUT_DIR}
mkdir -p "$out"
name=$(basename "$binary")

objcopy --only-keep-debug "$binary" "$out/$name.debug.tmp"
objcopy --strip-debug "$binary" "$out/$name.tmp"
# The link holds the debug file's name and CRC, computed here: run where the debug file is
# named as the link will name it.
mv "$out/$name.debug.tmp" "$out/$name.debug"
(cd "$out" && objcopy --add-gnu-debuglink="$name.debug" "$name.tmp" && mv "$name.tmp" "$name")
chmod 0644 "$out/$name.debug"

mib() { awk -v bytes="$(stat -c %s "$1")" 'BEGIN { printf "%.1f", bytes / 1048576 }'; }
echo "split-debug: built=$(mib "$binary") stripped=$(mib "$out/$name") debug=$(mib "$out/$name.debug") (MiB)"
