# Throwaway Postgres cluster for the demo and the benchmarks (sourced, not run).
# After `pgcluster_start`, PGC_WORK, PGC_DATA, PGC_PORT and PGC_BINDIR are set and `pgc_psql`,
# `pgc_pgbench` run the client tools against it; `pgcluster_stop` removes everything.

PGC_BINDIR=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
PGC_USER=postgres   # initdb and postgres refuse to run as root

pgc_as_pg() { runuser -u "$PGC_USER" -- "$@"; }

pgcluster_start() {
  PGC_WORK=$(mktemp -d /tmp/pgscope-cluster.XXXXXX)
  chown "$PGC_USER" "$PGC_WORK"
  PGC_DATA="$PGC_WORK/data"
  PGC_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  pgc_as_pg "$PGC_BINDIR/initdb" -D "$PGC_DATA" -U postgres --auth=trust >/dev/null
  pgc_as_pg "$PGC_BINDIR/pg_ctl" -D "$PGC_DATA" -w -l "$PGC_WORK/postgres.log" \
    -o "-p $PGC_PORT -k $PGC_WORK -c listen_addresses=127.0.0.1 -c shared_buffers=128MB $*" start >/dev/null
}

pgcluster_stop() {
  [[ -n ${PGC_DATA:-} ]] || return 0
  pgc_as_pg "$PGC_BINDIR/pg_ctl" -D "$PGC_DATA" stop -m immediate >/dev/null 2>&1 || true
  rm -rf "$PGC_WORK"
  PGC_DATA=
}

pgc_psql() { pgc_as_pg "$PGC_BINDIR/psql" -XAtq -h "$PGC_WORK" -p "$PGC_PORT" -U postgres "$@"; }
pgc_pgbench() { pgc_as_pg "$PGC_BINDIR/pgbench" -h "$PGC_WORK" -p "$PGC_PORT" -U postgres "$@"; }
