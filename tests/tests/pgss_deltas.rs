//! What a statement did over a trace in pg_stat_statements' own counters: the summary's
//! `pg_stat_statements` has each named statement's growth in every additive column, and the
//! findings that name a statement quote it. pgbench's select run an exact number of times
//! must show exactly that many calls; a sort given too little `work_mem` must show the
//! temporary blocks it wrote, as pg_stat_statements read by the test around the trace does.

use std::collections::BTreeMap;

use anyhow::{ensure, Context, Result};
use pgscope_tests::findings_json::read_findings;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// pgbench's select-only transactions per client, and its clients: exactly this many calls.
const TRANSACTIONS: u32 = 400;
const CLIENTS: u32 = 2;

/// A sort of 200000 rows in 64 kB of work_mem spills to temporary files.
const SPILLING_SORT: &str =
    "SET work_mem = '64kB'; SELECT g FROM generate_series(1, 200000) g ORDER BY g DESC LIMIT 1";
const SORTS: usize = 3;

/// The sort's queryid and its `temp_blks_written` so far (0 before its first run).
fn sort_temp_blocks(cluster: &PgCluster) -> Result<Option<(String, f64)>> {
    let row = cluster.psql(
        "SELECT queryid, temp_blks_written FROM pg_stat_statements \
         WHERE query LIKE 'SELECT g FROM generate_series%'",
    )?;
    let row = row.trim();
    if row.is_empty() {
        return Ok(None);
    }
    let (queryid, blocks) = row.split_once('|').context("queryid|temp_blks_written")?;
    Ok(Some((queryid.to_string(), blocks.parse()?)))
}

#[test]
fn a_statements_pg_stat_statements_counters_over_the_trace_are_in_the_summary_and_its_findings() -> Result<()>
{
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-s", "1", "-q"])?;
    // One sort before the trace, so that its entry exists at the start and the delta is the
    // trace's runs alone.
    cluster.psql(SPILLING_SORT)?;
    let (sort_queryid, blocks_before) =
        sort_temp_blocks(&cluster)?.context("the sort is not in pg_stat_statements")?;

    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::instance(cluster.data_dir())
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    cluster.pgbench(&[
        "-n",
        "-S",
        "-c",
        &CLIENTS.to_string(),
        "-j",
        "2",
        "-t",
        &TRANSACTIONS.to_string(),
    ])?;
    for _ in 0..SORTS {
        cluster.psql(SPILLING_SORT)?;
    }
    trace.interrupt()?;
    let summary = TraceSummary::read(&json)?;
    let (_, blocks_after) = sort_temp_blocks(&cluster)?.context("the sort left pg_stat_statements")?;

    let select = cluster.psql(
        "SELECT queryid FROM pg_stat_statements WHERE query LIKE 'SELECT abalance FROM pgbench_accounts%'",
    )?;
    let select = select.trim();
    let delta = summary
        .pgss_delta(select)?
        .with_context(|| format!("no pg_stat_statements counters for pgbench's select {select}"))?;
    eprintln!("pgbench's select over the trace: {delta:?}");
    let expected = f64::from(TRANSACTIONS * CLIENTS);
    ensure!(
        delta.get("calls") == Some(&expected),
        "pgbench ran its select {expected} times; the summary says {:?} calls",
        delta.get("calls")
    );
    ensure!(
        delta.get("rows") == Some(&expected),
        "each select returns one row; the summary says {:?} rows",
        delta.get("rows")
    );

    let sort = summary
        .pgss_delta(&sort_queryid)?
        .with_context(|| format!("no pg_stat_statements counters for the sort {sort_queryid}"))?;
    let written = sort.get("temp_blks_written").copied().unwrap_or(0.0);
    eprintln!(
        "the sort over the trace: {written} temporary blocks written; pg_stat_statements read \
         around the trace: {}",
        blocks_after - blocks_before
    );
    ensure!(
        written > 0.0 && written == blocks_after - blocks_before,
        "the sort wrote {} temporary blocks over the trace by pg_stat_statements; the summary \
         says {written}",
        blocks_after - blocks_before
    );
    ensure!(
        sort.get("calls") == Some(&(SORTS as f64)),
        "the sort ran {SORTS} times in the trace: {sort:?}"
    );

    // The findings that name the select quote its counts.
    let findings = read_findings(&json)?;
    let quoted: BTreeMap<&str, &str> = findings
        .iter()
        .filter(|f| f.queryids.first().map(String::as_str) == Some(select))
        .filter_map(|f| Some((f.kind.as_str(), f.number("pg_stat_statements over the trace")?)))
        .collect();
    eprintln!("findings quoting the select's counters: {quoted:?}");
    ensure!(
        !quoted.is_empty()
            && quoted
                .values()
                .all(|v| v.starts_with(&format!("{expected:.0} calls"))),
        "no finding of pgbench's select quotes its {expected} calls: {quoted:?}"
    );
    Ok(())
}
