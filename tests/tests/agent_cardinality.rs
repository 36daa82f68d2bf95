//! Bounded series with a real Pyroscope: with `labels.top_queryids = 5` and 20 distinct
//! statements, the 5 heaviest keep their `queryid` label (and a `query` label with their
//! normalized text), the rest arrive as `queryid="other"`, and the weight folded into `other`
//! is the light statements' share of the work (pg_stat_statements' execution time), not lost.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, PgCluster, PgInstall, RunningAgent};
use serde_json::json;

const STATEMENTS: usize = 20;
const HEAVY: usize = 5;
/// Rows the heavy and the light statements sum: five times the work apart, so that no light
/// one outweighs a heavy one in any interval.
const HEAVY_ROWS: u32 = 300_000;
const LIGHT_ROWS: u32 = 60_000;

fn table(i: usize) -> String {
    format!("cardinality_t{i}")
}

/// As sent: with a constant, which pg_stat_statements' text replaces by `$1`.
fn statement(i: usize) -> String {
    format!("SELECT sum(x) FROM {} WHERE x > 0", table(i))
}

fn normalized(i: usize) -> String {
    format!("SELECT sum(x) FROM {} WHERE x > $1", table(i))
}

/// Statement i's queryid and execution time (ms) from pg_stat_statements.
fn pgss_row(cluster: &PgCluster, i: usize) -> Result<(String, f64)> {
    let row = cluster.psql(&format!(
        "SELECT queryid || ' ' || total_exec_time FROM pg_stat_statements WHERE query = '{}'",
        normalized(i)
    ))?;
    let (id, ms) = row
        .trim()
        .split_once(' ')
        .with_context(|| format!("`{}` not in pg_stat_statements: `{row}`", normalized(i)))?;
    Ok((id.to_string(), ms.parse()?))
}

/// The merged process_cpu total (ns) of the series `selector` matches.
fn cpu_total(
    pyroscope: &PyroscopeServer,
    profile_type: &str,
    selector: &str,
    start: i64,
    end: i64,
) -> Result<u64> {
    let answer = pyroscope.call(
        "SelectMergeStacktraces",
        json!({"profileTypeID": profile_type, "labelSelector": selector, "start": start, "end": end}),
    )?;
    Ok(answer["flamegraph"]["total"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0))
}

#[test]
fn the_top_queryids_keep_their_labels_and_the_rest_arrive_as_other() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let install = PgInstall::distro()?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    let scripts = tempfile::tempdir()?;
    let mut args = vec![
        "-n".to_string(),
        "-c".into(),
        "2".into(),
        "-j".into(),
        "2".into(),
        "-T".into(),
        "300".into(),
    ];
    for i in 1..=STATEMENTS {
        let rows = if i <= HEAVY { HEAVY_ROWS } else { LIGHT_ROWS };
        cluster.psql(&format!(
            "CREATE TABLE {} AS SELECT g AS x FROM generate_series(1, {rows}) g",
            table(i)
        ))?;
        cluster.psql(&format!("VACUUM ANALYZE {}", table(i)))?;
        let path = scripts.path().join(format!("statement{i}.sql"));
        std::fs::write(&path, format!("{};\n", statement(i)))?;
        args.extend(["-f".to_string(), path.display().to_string()]);
    }
    cluster.psql("SELECT pg_stat_statements_reset()")?;

    let service = format!("pgscope-cardinality-{}-{}", std::process::id(), now_ms());
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nfrequency = 99\nupload_interval = \"3s\"\n\
         [labels]\nservice_name = \"{service}\"\ntop_queryids = {HEAVY}\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        pyroscope.url(),
        cluster.data_dir().display()
    );
    let start = now_ms();
    let agent = RunningAgent::start(&config, &[])?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let pgbench = cluster.spawn_pgbench(&args, 2)?;
    agent.wait_metric(
        "pgscope_export_pushes_total{result=\"ok\"}",
        "six pushes accepted by Pyroscope",
        Duration::from_secs(120),
        |pushes| pushes >= 6.0,
    )?;
    pgbench.stop()?;
    let folded = agent.metric("pgscope_series_folded_total{reason=\"queryid_top_k\"}")?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    ensure!(folded > 0.0, "no series counted as folded by the top-K queryids");
    let end = now_ms() + 1000;

    let rows: BTreeMap<usize, (String, f64)> = (1..=STATEMENTS)
        .map(|i| Ok((i, pgss_row(&cluster, i)?)))
        .collect::<Result<_>>()?;
    let heavy: BTreeSet<String> = rows.range(..=HEAVY).map(|(_, (id, _))| id.clone()).collect();
    let selector = format!("{{service_name=\"{service}\"}}");
    let values = wait_for(
        "the queryid label values in Pyroscope",
        Duration::from_secs(60),
        || {
            let values = pyroscope.label_values("queryid", &selector, start, end)?;
            Ok(values.contains("other").then_some(values))
        },
    )?;
    eprintln!("queryid values in Pyroscope: {values:?}; heavy statements: {heavy:?}");
    let mut expected = heavy.clone();
    expected.insert("other".to_string());
    ensure!(
        values == expected,
        "the labelled queryids are not the {HEAVY} heaviest and `other`: {values:?}, expected {expected:?}"
    );

    // The labelled statements carry their normalized text; `other` carries none.
    let texts = pyroscope.label_values("query", &selector, start, end)?;
    let expected: BTreeSet<String> = (1..=HEAVY).map(normalized).collect();
    ensure!(
        texts == expected,
        "the query label values are not the heavy statements' texts: {texts:?}"
    );
    let other_texts = pyroscope.label_values(
        "query",
        &format!("{{service_name=\"{service}\",queryid=\"other\"}}"),
        start,
        end,
    )?;
    ensure!(other_texts.is_empty(), "`other` has query texts: {other_texts:?}");

    // The weight under `other` is the light statements' (and pgscope's own catalog reads'):
    // their share of the work, as pg_stat_statements timed it, within 10 points.
    let types = pyroscope.call("ProfileTypes", json!({"start": start, "end": end}))?;
    let cpu_type = types["profileTypes"]
        .as_array()
        .and_then(|t| {
            t.iter()
                .filter_map(|t| t["ID"].as_str())
                .find(|id| id.starts_with("process_cpu:cpu:nanoseconds:cpu:nanoseconds"))
        })
        .context("no process_cpu profile type in Pyroscope")?
        .to_string();
    let by_value = |value: &str| {
        let selector = format!("{{service_name=\"{service}\",queryid=\"{value}\"}}");
        cpu_total(&pyroscope, &cpu_type, &selector, start, end)
    };
    let other = by_value("other")? as f64;
    let mut labelled = other;
    for id in &heavy {
        let total = by_value(id)?;
        ensure!(total > 0, "no CPU under queryid {id}");
        labelled += total as f64;
    }
    let light_ms: f64 = rows.range(HEAVY + 1..).map(|(_, (_, ms))| ms).sum();
    let all_ms: f64 = rows.values().map(|(_, ms)| ms).sum();
    let sampled_share = other / labelled;
    let timed_share = light_ms / all_ms;
    eprintln!(
        "other: {:.1}% of the CPU under a queryid; the light statements: {:.1}% of the execution time",
        100.0 * sampled_share,
        100.0 * timed_share
    );
    ensure!(
        (sampled_share - timed_share).abs() <= 0.10,
        "`other` holds {:.1}% of the CPU, the light statements took {:.1}% of the time",
        100.0 * sampled_share,
        100.0 * timed_share
    );
    Ok(())
}
