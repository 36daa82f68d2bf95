//! What the instance did over a trace in Postgres' own instance-wide counters: the summary's
//! `pg_stat_database` and, from PostgreSQL 16, `pg_stat_io` hold what their counters grew by
//! while pgscope traced. Judged against what the test made the instance do: sorts that spill
//! each leave one temporary file, committed transactions are at least those it ran, and a
//! table written in bulk was extended by at least its own size.

use anyhow::{ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// A sort of 200000 rows in 64 kB of work_mem spills to one temporary file.
const SPILLING_SORT: &str =
    "SET work_mem = '64kB'; SELECT g FROM generate_series(1, 200000) g ORDER BY g DESC LIMIT 1";
const SORTS: usize = 4;
/// pgbench's select-only transactions, one client.
const TRANSACTIONS: u32 = 300;

/// Traces `cluster`'s instance while `work` runs, and reads the summary.
fn traced(cluster: &PgCluster, work: impl FnOnce() -> Result<()>) -> Result<TraceSummary> {
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::instance(cluster.data_dir())
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    work()?;
    trace.interrupt()?;
    TraceSummary::read(&json)
}

#[test]
fn a_traces_pg_stat_database_counts_the_sorts_that_spilled_and_the_transactions() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    let summary = traced(&cluster, || {
        for _ in 0..SORTS {
            cluster.psql(SPILLING_SORT)?;
        }
        cluster.pgbench(&["-n", "-S", "-c", "1", "-t", &TRANSACTIONS.to_string()])?;
        Ok(())
    })?;
    let database = summary
        .stat_view_delta("pg_stat_database", "postgres")?
        .context("no pg_stat_database counters for the database `postgres`")?;
    eprintln!("pg_stat_database over the trace: {database:?}");
    let counter = |name: &str| database.get(name).copied().unwrap_or(0.0);
    ensure!(
        counter("temp_files") == SORTS as f64,
        "{SORTS} sorts spilled one temporary file each; the summary says {}",
        counter("temp_files")
    );
    ensure!(
        counter("temp_bytes") > 0.0,
        "temporary files of no size: {database:?}"
    );
    ensure!(
        counter("xact_commit") >= f64::from(TRANSACTIONS) + SORTS as f64,
        "{TRANSACTIONS} transactions and {SORTS} sorts committed; the summary says {} commits",
        counter("xact_commit")
    );
    // PostgreSQL 15 has no pg_stat_io: nothing is made up for it.
    ensure!(
        summary.stat_view_rows("pg_stat_io")?.is_empty(),
        "pg_stat_io rows on PostgreSQL 15: {:?}",
        summary.stat_view_rows("pg_stat_io")?
    );
    Ok(())
}

#[test]
fn a_traces_pg_stat_io_has_the_extends_of_a_table_written_in_bulk_on_17() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(&PgInstall::upstream(17)?, &[])?;
    let summary = traced(&cluster, || {
        cluster.psql("CREATE TABLE bulk AS SELECT g, md5(g::text) AS h FROM generate_series(1, 200000) g")?;
        Ok(())
    })?;
    let size: f64 = cluster
        .psql("SELECT pg_relation_size('bulk')")?
        .trim()
        .parse()
        .context("pg_relation_size")?;
    let rows = summary.stat_view_rows("pg_stat_io")?;
    eprintln!("pg_stat_io rows that moved: {rows:?}");
    let bulk = summary
        .stat_view_delta("pg_stat_io", "client backend/relation/bulkwrite")?
        .with_context(|| format!("no client backend bulk writes in pg_stat_io: {rows:?}"))?;
    eprintln!("client backend/relation/bulkwrite over the trace: {bulk:?}; the table has {size} bytes");
    let extends = bulk.get("extends").copied().unwrap_or(0.0);
    let block = bulk.get("op_bytes").copied().unwrap_or(8192.0);
    ensure!(
        extends * block >= size,
        "the table has {size} bytes; pg_stat_io counted {extends} extends"
    );
    Ok(())
}
