#!/usr/bin/env bash
# `make test-kernels`: what pgscope gets on each kernel users run. Boots Debian's 5.10, 6.1 and
# 6.12 (scripts/kernels.sh) with virtme-ng, the host's root shared read-only, and runs
# scripts/kernel-smoke.sh in each guest; then the same on the host's own kernel.
#
# Usage: scripts/test-kernels.sh PGSCOPE
# Ends with one line, e.g. `kernels: 5.10=refused 6.1=ok 6.12=ok 6.18=ok`, after a line per
# kernel saying what each part got. Exits 1 when a kernel's result is not the one expected of it
# (EXPECTED below), 0 otherwise.
#
# KVM when /dev/kvm boots a guest (tried once, the answer kept for the run), else TCG: on this
# project's CI machine nested KVM hangs at boot, and TCG takes ~40 s to boot and runs the smoke
# several times slower.
set -uo pipefail

bin=$(realpath "$1")
cd "$(dirname "$0")/.."

# What each series must give: 5.10 has no task storage maps (5.11) nor bpf_task_pt_regs (5.15),
# and pgscope refuses it, saying so.
declare -A EXPECTED=([5.10]=refused [6.1]=ok [6.12]=ok)
GUEST_TIMEOUT=900

log() { echo "test-kernels: $*" >&2; }

cache=${PGSCOPE_CACHE:-/var/cache/pgscope}
lines=$(scripts/kernels.sh) || { log "cannot get the kernels (scripts/kernels.sh above)"; exit 1; }
vng=$(awk '$1 == "vng" {print $2}' <<<"$lines")
# vng runs virtme-run from its own directory.
PATH=$(dirname "$vng"):$PATH

work=$(mktemp -d /tmp/pgscope-kernels.XXXXXX)
chmod 755 "$work"

# KVM or TCG: a guest that boots under KVM within a minute says KVM works.
accel=(--disable-kvm)
first=$(awk '$1 != "vng" {print $3; exit}' <<<"$lines")
if [[ -w /dev/kvm ]] && timeout 60 "$vng" --run "$first" --cpus 1 --memory 1G --exec true >/dev/null 2>&1; then
  accel=()
  log "KVM boots guests: using it"
else
  log "KVM does not boot guests here: using TCG (emulation)"
fi

summary=()
failed=0
while read -r series release vmlinuz; do
  [[ $series == vng ]] && continue
  dir=$work/$series
  mkdir -p "$dir"
  log "booting $release"
  # The guest's /var is its own: the cache (Pyroscope's build, the kernels) is shared read-only.
  timeout "$GUEST_TIMEOUT" "$vng" --run "$vmlinuz" --cpus 2 --memory 3G "${accel[@]}" --rwdir "$dir" \
    --rodir "$cache" --exec "scripts/kernel-smoke.sh $bin $dir" >"$dir/guest.log" 2>&1
  rc=$?
  if [[ -f $dir/result ]]; then
    result=$(cat "$dir/result")
  else
    result="failed the guest ended (exit $rc) without a result: $(tail -n 3 "$dir/guest.log" | tr '\n' ' ')"
  fi
  word=${result%% *}
  echo "$series ($release): $result"
  [[ $word == "${EXPECTED[$series]:-ok}" ]] || failed=1
  summary+=("$series=$word")
done <<<"$lines"

host_series=$(uname -r | cut -d. -f1,2)
log "on the host's kernel, $(uname -r)"
scripts/kernel-smoke.sh "$bin" "$work/host"
result=$(cat "$work/host/result" 2>/dev/null || echo "failed no result")
echo "$host_series ($(uname -r), host): $result"
[[ ${result%% *} == ok ]] || failed=1
summary+=("$host_series=${result%% *}")

echo "kernels: ${summary[*]}"
# The logs the result lines name stay when a kernel did not give what it should.
if ((failed)); then
  log "logs of each kernel: $work/<series>/"
else
  rm -rf "$work"
fi
exit "$failed"
