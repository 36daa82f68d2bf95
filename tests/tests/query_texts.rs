//! The summary names queries by their normalized text from pg_stat_statements, read at the end
//! of a trace over the instance's own Unix socket; when it cannot connect it says so and the
//! trace still succeeds.

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::CPU_BOUND;
use pgscope_tests::{require_root_and_bpf, LabeledProfile, PgCluster, PgInstall, Trace};
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
    let script = dir.path().join("burn.sql");
    std::fs::write(&script, SCRIPT)?;
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let script_arg = script.to_str().context("temp path is not UTF-8")?;
    let _load = cluster.spawn_pgbench(&["-n", "-c", "1", "-T", "60", "-f", script_arg], 1)?;
    let json = dir.path().join("summary.json");
    let output = Trace::instance(cluster.data_dir())
        .duration_secs(3)
        .json(&json)
        .output()?;
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
