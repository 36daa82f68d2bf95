//! The summary names queries by their normalized text from pg_stat_statements, read at the end
//! of a trace over the instance's own Unix socket from a database that has the extension; when
//! it cannot connect, or no database has it, it says so and the trace still succeeds.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::process::run_checked;
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{require_root_and_bpf, LabeledProfile, PgCluster, PgInstall, Trace, TraceOutput};
use serde_json::Value;

fn queries(json: &std::path::Path) -> Result<Vec<Value>> {
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(json)?)?;
    Ok(summary["queries"]
        .as_array()
        .context("queries[] in the summary")?
        .clone())
}

/// Statements that finish: pg_stat_statements shows an entry only once it has been executed
/// (a first execution still running is a hidden "sticky" entry), and pgscope never falls back
/// to pg_stat_activity's raw text, which holds the constants.
const SCRIPT: &str = "SELECT count(*) FROM generate_series(1, 300000) g WHERE g % 7 = 3;\n";

#[test]
fn busiest_query_is_named_by_its_normalized_text() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let dir = tempfile::tempdir()?;
    let (output, json) = trace_script(&cluster, dir.path())?;
    ensure!(
        !output.stderr.contains("no query texts"),
        "pgscope could not read query texts:\n{}",
        output.stderr
    );

    let expected = cluster.psql(
        "SELECT query FROM pg_stat_statements WHERE query LIKE '%generate_series%' AND query NOT LIKE '%pg_stat_statements%'",
    )?;
    let busiest = queries(&json)?
        .into_iter()
        .find(|q| q["queryid"] != "0")
        .context("no query with a queryid in the summary")?;
    let text = busiest["query"]
        .as_str()
        .context("the busiest query has no text")?;
    eprintln!("busiest query: {} {text}", busiest["queryid"]);
    ensure!(
        text == expected.trim(),
        "summary text `{text}` differs from pg_stat_statements `{}`",
        expected.trim()
    );
    ensure!(
        text.contains("$1"),
        "the text is not normalized (constants must be $n): {text}"
    );
    ensure!(
        output.stdout.contains(text),
        "the printed summary does not show the text:\n{}",
        output.stdout
    );
    Ok(())
}

/// Without a connection there are no texts and no database names: one line says so, and the
/// database label stays the OID (pg_stat_activity's `datid`).
#[test]
fn unreachable_instance_is_reported_and_the_trace_still_succeeds() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let session = cluster.spawn_session(CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let pprof = dir.path().join("profile.pb.gz");
    let output = Trace::pid(session.pid())
        .duration_secs(2)
        .json(&json)
        .pprof(&pprof)
        .conninfo(&format!("host={} port=1 user=postgres", dir.path().display()))
        .output()?;
    let missing: Vec<&str> = output
        .stderr
        .lines()
        .filter(|line| line.contains("no query texts") || line.contains("database names"))
        .collect();
    ensure!(
        missing.len() == 1
            && missing[0].contains("no query texts or database names")
            && missing[0].contains("--conninfo"),
        "expected one line saying why there are no texts and no database names:\n{}",
        output.stderr
    );
    let queries = queries(&json)?;
    ensure!(!queries.is_empty(), "the trace lost its samples");
    ensure!(
        queries.iter().all(|q| q["query"].is_null()),
        "texts appeared without a connection"
    );
    let datid = cluster.psql(&format!(
        "SELECT datid FROM pg_stat_activity WHERE pid = {}",
        session.pid()
    ))?;
    let databases = LabeledProfile::read_pprof(&pprof)?.label_values("database", |_| true);
    eprintln!("database labels without a connection: {databases:?} (datid {datid})");
    ensure!(
        databases.len() == 1 && databases.contains_key(&Some(datid.clone())),
        "the database label is not the OID {datid} on every sample: {databases:?}"
    );
    Ok(())
}

/// `psql -c sql` in database `database` of `cluster`.
fn psql_in(cluster: &PgCluster, database: &str, sql: &str) -> Result<String> {
    let mut command = cluster.psql_command();
    // The last -d wins: psql_command names `postgres`.
    command.args(["-d", database, "-c", sql]);
    let out = run_checked(&mut command, Duration::from_secs(60))
        .with_context(|| format!("query failed in database {database}: {sql}"))?;
    Ok(out.trim_end_matches('\n').to_owned())
}

/// Traces the instance for 3 s while pgbench runs [`SCRIPT`], and returns pgscope's output and
/// summary file.
fn trace_script(cluster: &PgCluster, dir: &std::path::Path) -> Result<(TraceOutput, std::path::PathBuf)> {
    let script = dir.join("burn.sql");
    std::fs::write(&script, SCRIPT)?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let script_arg = script.to_str().context("temp path is not UTF-8")?;
    let _load = cluster.spawn_pgbench(&["-n", "-c", "1", "-T", "60", "-f", script_arg], 1)?;
    let json = dir.join("summary.json");
    let output = Trace::instance(cluster.data_dir())
        .duration_secs(3)
        .json(&json)
        .output()?;
    Ok((output, json))
}

/// A cluster with pg_stat_statements loaded but created in no database, and a database `app`.
fn loaded_with_database_app() -> Result<PgCluster> {
    let cluster = PgCluster::start_with(
        &PgInstall::distro()?,
        &[("shared_preload_libraries", "pg_stat_statements")],
    )?;
    cluster.psql("CREATE DATABASE app")?;
    Ok(cluster)
}

/// As on most real servers, the extension is created in the application's database only, not in
/// `postgres` where pgscope connects: its texts are read from there.
#[test]
fn texts_come_from_the_database_that_has_the_extension() -> Result<()> {
    require_root_and_bpf();
    let cluster = loaded_with_database_app()?;
    psql_in(&cluster, "app", "CREATE EXTENSION pg_stat_statements")?;
    ensure!(
        cluster.psql("SELECT to_regclass('pg_stat_statements') IS NULL")? == "t",
        "the extension must not be in database postgres for this test"
    );
    let dir = tempfile::tempdir()?;
    let (output, json) = trace_script(&cluster, dir.path())?;
    ensure!(
        !output.stderr.contains("no query texts") && !output.stderr.contains("pg_stat_statements is"),
        "pgscope did not read the texts from database app:\n{}",
        output.stderr
    );
    let expected = psql_in(
        &cluster,
        "app",
        "SELECT query FROM pg_stat_statements WHERE query LIKE '%generate_series%' AND query NOT LIKE '%pg_stat_statements%'",
    )?;
    let named = queries(&json)?
        .into_iter()
        .filter_map(|q| q["query"].as_str().map(str::to_owned))
        .collect::<Vec<_>>();
    ensure!(
        named.iter().any(|text| text == expected.trim()),
        "no query of the summary has pg_stat_statements' text `{}`: {named:?}",
        expected.trim()
    );
    Ok(())
}

/// Loaded but created nowhere: one line says so and how to add it; the trace still succeeds.
#[test]
fn an_extension_created_nowhere_is_said_once_with_the_fix() -> Result<()> {
    require_root_and_bpf();
    let cluster = loaded_with_database_app()?;
    let dir = tempfile::tempdir()?;
    let (output, json) = trace_script(&cluster, dir.path())?;
    let said: Vec<&str> = output
        .stderr
        .lines()
        .filter(|line| line.contains("pg_stat_statements is"))
        .collect();
    ensure!(
        said.len() == 1
            && said[0].contains("loaded but not created in any database")
            && said[0].contains("CREATE EXTENSION pg_stat_statements"),
        "expected one line saying the extension is created nowhere and how to add it:\n{}",
        output.stderr
    );
    ensure!(!queries(&json)?.is_empty(), "the trace lost its samples");
    Ok(())
}
