//! One cause under many statements is one finding. The same command over several tables runs
//! under one queryid per table (a utility statement's queryid is its text's); when each is
//! dominated by the same function, the finding names the function once, lists the statements
//! with their text and says what they cost together — checked against pg_stat_statements'
//! own execution time of those statements. The same workload where nothing dominates raises
//! nothing above information. The statements run in an application database, whose catalog
//! (not `postgres`') is what the finding quotes.

use std::collections::BTreeSet;

use anyhow::{ensure, Context, Result};
use pgscope_tests::app_database::{pgbench_in, psql_in};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace};
use serde_json::Value;

/// Tables vacuumed in turn, each its own statement.
const TABLES: u32 = 6;
/// The database they are in.
const APP: &str = "app";

/// pg_stat_statements' total execution time in ms, by queryid.
type ExecMs = Vec<(String, f64)>;

/// The JSON findings of a trace of `VACUUM t<n>` over [`TABLES`] tables for 6 s with
/// `relations` views beside them (pg_class rows every VACUUM's vac_update_datfrozenxid scans),
/// probing vac_update_datfrozenxid; and pg_stat_statements' total execution time of the
/// VACUUMs by queryid, over the same window.
fn vacuums_beside(relations: u32) -> Result<(Vec<Value>, ExecMs)> {
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.psql(&format!("CREATE DATABASE {APP}"))?;
    for table in 1..=TABLES {
        psql_in(
            &cluster,
            APP,
            &format!("CREATE TABLE t{table} (x int); INSERT INTO t{table} VALUES (1)"),
        )?;
    }
    psql_in(
        &cluster,
        APP,
        &format!(
            // A commit every thousand views: each holds a lock until its transaction ends.
            "DO $$ BEGIN FOR i IN 1..{relations} LOOP \
         EXECUTE format('CREATE VIEW v%s AS SELECT 1 AS x', i); \
         IF i % 1000 = 0 THEN COMMIT; END IF; END LOOP; END $$"
        ),
    )?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("vacuum.sql");
    std::fs::write(&script, format!("\\set n random(1, {TABLES})\nVACUUM t:n;\n"))?;
    let json = dir.path().join("summary.json");
    cluster.psql("SELECT pg_stat_statements_reset()")?;
    let trace = Trace::instance(cluster.data_dir())
        .probes("vac_update_datfrozenxid")
        .probe_budget("none")
        .json(&json)
        .duration_secs(600)
        .spawn()?;
    let script = script.display().to_string();
    pgbench_in(&cluster, APP, &["-n", "-c", "1", "-T", "6", "-f", &script])?;
    let output = trace.interrupt()?;
    eprintln!("{}", output.stdout);
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let findings = summary["findings"]
        .as_array()
        .context("findings[] in the JSON summary")?
        .clone();
    let exec_ms = cluster
        .psql(
            "SELECT queryid || ' ' || total_exec_time FROM pg_stat_statements WHERE query LIKE 'VACUUM t%'",
        )?
        .lines()
        .filter_map(|line| {
            let (queryid, ms) = line.split_once(' ')?;
            Some((queryid.to_string(), ms.parse().ok()?))
        })
        .collect();
    Ok((findings, exec_ms))
}

fn queryids(finding: &Value) -> BTreeSet<String> {
    finding["queryids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|q| q.as_str().map(String::from))
        .collect()
}

#[test]
fn one_function_dominating_the_same_command_on_many_tables_is_one_finding() -> Result<()> {
    require_root_and_bpf();
    let (found, exec_ms) = vacuums_beside(20_000)?;
    let vacuums: BTreeSet<String> = exec_ms.iter().map(|(q, _)| q.clone()).collect();
    ensure!(
        vacuums.len() as u32 == TABLES,
        "pg_stat_statements has {} VACUUM statements, not {TABLES}: {exec_ms:?}",
        vacuums.len()
    );
    let naming: Vec<&Value> = found
        .iter()
        .filter(|f| {
            f["functions"]
                .as_array()
                .is_some_and(|fs| fs.iter().any(|n| n == "vac_update_datfrozenxid"))
        })
        .collect();
    ensure!(
        naming.len() == 1,
        "{} findings name vac_update_datfrozenxid; one cause is one finding: {found:#?}",
        naming.len()
    );
    let finding = naming[0];
    // The catalog VACUUM scans is the application database's, where the views are.
    let quoted = finding["numbers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["what"] == format!("pg_class rows (database {APP})"))
        .and_then(|n| n["value"].as_str()?.parse::<u64>().ok());
    ensure!(
        quoted.is_some_and(|rows| rows >= 20_000),
        "the finding does not quote the {APP} database's pg_class ({quoted:?} rows): {finding:#}"
    );
    let covered = queryids(finding);
    ensure!(
        covered.len() >= 2 && covered.is_subset(&vacuums),
        "the finding covers {covered:?}, the VACUUMs are {vacuums:?}"
    );
    let title = finding["title"].as_str().unwrap_or("");
    ensure!(
        title.starts_with(&format!(
            "{} VACUUM statements spend most of their",
            covered.len()
        )) && title.ends_with("in vac_update_datfrozenxid"),
        "title: {title}"
    );
    ensure!(
        finding["statements"]
            .as_array()
            .is_some_and(|s| s.len() == covered.len()
                && s.iter()
                    .all(|s| s["figure"].as_str().is_some_and(|f| f.contains('%')))),
        "each statement is listed with its own figure: {finding:#}"
    );
    ensure!(
        covered.iter().all(|q| finding["query_texts"][q]
            .as_str()
            .is_some_and(|t| t.starts_with("VACUUM t"))),
        "each statement is listed with its text: {finding:#}"
    );
    ensure!(
        matches!(finding["severity"].as_str(), Some("warning" | "critical")),
        "VACUUMs spending most of their time in one function are all the instance does: {finding:#}"
    );
    // What the finding says the cause cost, against what pg_stat_statements timed the same
    // statements' execution at: the function is most of each statement, so the two agree
    // within a factor of 2.
    let cost_ms = finding["cost_ns"].as_u64().context("cost_ns")? as f64 / 1e6;
    let exec_ms: f64 = exec_ms
        .iter()
        .filter(|(q, _)| covered.contains(q))
        .map(|(_, ms)| ms)
        .sum();
    eprintln!("grouped cost {cost_ms:.0} ms; pg_stat_statements' execution time of the same statements {exec_ms:.0} ms");
    ensure!(
        cost_ms <= exec_ms * 2.0 && cost_ms * 2.0 >= exec_ms,
        "the finding's cost {cost_ms:.0} ms is not within a factor of 2 of the {exec_ms:.0} ms \
         pg_stat_statements timed"
    );

    let (calm, _) = vacuums_beside(0)?;
    let alarms: Vec<&Value> = calm.iter().filter(|f| f["severity"] != "info").collect();
    ensure!(
        alarms.is_empty(),
        "VACUUMs of small tables beside a few hundred pg_class rows raised: {alarms:#?}"
    );
    Ok(())
}
