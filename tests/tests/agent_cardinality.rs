//! Bounded series with a real Pyroscope: with `labels.top_queryids = 5` and 20 distinct
//! statements, the 5 heaviest keep their `queryid` label (and a `query` label with their
//! normalized text), the rest arrive as `queryid="other"`, and the weight folded into `other`
//! is the light statements' share of the work, not lost.
//!
//! The heavy and the light statements run on backends of their own (two pgbench runs), so
//! that each group's work is the CPU time the scheduler gave its backends over the window the
//! agent sampled: a share of CPU samples is compared with a share of CPU time of the same run,
//! never with execution time, which on a busy machine includes the time spent waiting for a CPU.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::pyroscope_server::{now_ms, PyroscopeServer};
use pgscope_tests::{require_root_and_bpf, wait_for, CpuWindow, PgCluster, PgInstall, RunningAgent};
use serde_json::json;

const STATEMENTS: usize = 20;
const HEAVY: usize = 5;
/// Backends running the heavy and the light statements. The scheduler shares the CPU evenly
/// between runnable backends however busy the machine is, so each heavy statement gets
/// 3/5 of a backend's CPU and each light one 1/15: nine times apart, and a light one cannot
/// outweigh a heavy one in any interval, on any machine (checked below on the run itself).
const HEAVY_CLIENTS: usize = 3;
const LIGHT_CLIENTS: usize = 1;
/// Rows the heavy and the light statements sum: the heavy ones also cost more per execution.
const HEAVY_ROWS: u32 = 300_000;
const LIGHT_ROWS: u32 = 60_000;
/// The shortest run the assertions allow: six pushes, so that the ranking is redone over six
/// intervals (a light statement that overtook a heavy one in any of them would keep a label),
/// and 12 CPU-seconds of the backends, ~1200 samples at 99 Hz: `other`'s share is then known
/// within ±2.5 points (binomial, 95%), well inside the 10 points allowed.
const PUSHES: f64 = 6.0;
const BACKEND_CPU: Duration = Duration::from_secs(12);
/// How long the workload may take to reach that; pgbench's `-T` outlives it and the agent's
/// start, and is stopped as soon as it is reached.
const RUN_BOUND: Duration = Duration::from_secs(300);
const FREQUENCY: u32 = 99;

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

/// Statement i's queryid from pg_stat_statements.
fn pgss_queryid(cluster: &PgCluster, i: usize) -> Result<String> {
    let id = cluster.psql(&format!(
        "SELECT queryid FROM pg_stat_statements WHERE query = '{}'",
        normalized(i)
    ))?;
    ensure!(
        !id.trim().is_empty(),
        "`{}` not in pg_stat_statements",
        normalized(i)
    );
    Ok(id.trim().to_string())
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

/// pgbench `-f` arguments, one script file per statement of `range`.
fn script_args(dir: &std::path::Path, range: std::ops::RangeInclusive<usize>) -> Result<Vec<String>> {
    let mut args = Vec::new();
    for i in range {
        let path = dir.join(format!("statement{i}.sql"));
        std::fs::write(&path, format!("{};\n", statement(i)))?;
        args.extend(["-f".to_string(), path.display().to_string()]);
    }
    Ok(args)
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn the_top_queryids_keep_their_labels_and_the_rest_arrive_as_other() -> Result<()> {
    require_root_and_bpf();
    let pyroscope = PyroscopeServer::get()?;
    let install = PgInstall::distro()?;
    let cluster = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    for i in 1..=STATEMENTS {
        let rows = if i <= HEAVY { HEAVY_ROWS } else { LIGHT_ROWS };
        cluster.psql(&format!(
            "CREATE TABLE {} AS SELECT g AS x FROM generate_series(1, {rows}) g",
            table(i)
        ))?;
        cluster.psql(&format!("VACUUM ANALYZE {}", table(i)))?;
    }
    cluster.psql("SELECT pg_stat_statements_reset()")?;

    // Both groups run before the agent starts, so that its first interval already holds
    // both: the ranking never sees one group without the other.
    let scripts = tempfile::tempdir()?;
    let bound = (2 * RUN_BOUND.as_secs()).to_string();
    let group = |range, clients: usize| -> Result<Vec<String>> {
        let clients = clients.to_string();
        let mut args: Vec<String> = ["-n", "-c", &clients, "-j", &clients, "-T", &bound]
            .iter()
            .map(|a| a.to_string())
            .collect();
        args.extend(script_args(scripts.path(), range)?);
        Ok(args)
    };
    let heavy_args = group(1..=HEAVY, HEAVY_CLIENTS)?;
    let light_args = group(HEAVY + 1..=STATEMENTS, LIGHT_CLIENTS)?;
    let mut heavy_run = cluster.spawn_pgbench(&as_strs(&heavy_args), HEAVY_CLIENTS)?;
    let mut light_run = cluster.spawn_pgbench(&as_strs(&light_args), LIGHT_CLIENTS)?;
    let heavy_pids = heavy_run.backend_pids()?;
    let light_pids = light_run.backend_pids()?;
    ensure!(
        heavy_pids.len() == HEAVY_CLIENTS && light_pids.len() == LIGHT_CLIENTS,
        "backends: heavy {heavy_pids:?}, light {light_pids:?}"
    );

    let service = format!("pgscope-cardinality-{}-{}", std::process::id(), now_ms());
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nfrequency = {FREQUENCY}\nupload_interval = \"3s\"\n\
         [labels]\nservice_name = \"{service}\"\ntop_queryids = {HEAVY}\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        pyroscope.url(),
        cluster.data_dir().display()
    );
    let start = now_ms();
    let agent = RunningAgent::start(&config, &[])?;
    // Started once the agent samples, read before the workload stops: the window the pushes
    // cover, less the moments at either end when both groups run alike.
    let all_pids: Vec<u32> = heavy_pids.iter().chain(&light_pids).copied().collect();
    let window = CpuWindow::start(&all_pids)?;
    let ok = "pgscope_export_pushes_total{result=\"ok\"}";
    let mut last = (0.0, Duration::ZERO, Duration::ZERO);
    wait_for(
        &format!("{PUSHES} pushes accepted by Pyroscope and {BACKEND_CPU:?} of the backends' CPU"),
        RUN_BOUND,
        || {
            ensure!(
                heavy_run.is_running()? && light_run.is_running()?,
                "pgbench ended before the run was long enough"
            );
            let used = window.used()?;
            last = (agent.metric(ok)?, used.on_cpu, used.runnable);
            Ok((last.0 >= PUSHES && last.1 >= BACKEND_CPU).then_some(()))
        },
    )
    .with_context(|| {
        format!(
            "reached {} pushes and {:?} of the backends' CPU (they waited {:?} for one)",
            last.0, last.1, last.2
        )
    })?;
    let used = window.used_by()?;
    heavy_run.stop()?;
    light_run.stop()?;
    let folded = agent.metric("pgscope_series_folded_total{reason=\"queryid_top_k\"}")?;
    let (status, log) = agent.terminate()?;
    ensure!(status.success(), "agent exit {status}:\n{log}");
    ensure!(folded > 0.0, "no series counted as folded by the top-K queryids");
    let end = now_ms() + 1000;

    let cpu_of = |pids: &[u32]| -> Duration {
        pids.iter()
            .filter_map(|pid| used.get(pid))
            .map(|t| t.on_cpu)
            .sum()
    };
    let (heavy_cpu, light_cpu) = (cpu_of(&heavy_pids), cpu_of(&light_pids));
    // The premise, on this run: every heavy statement had clearly more of the CPU than any
    // light one. Within a group pgbench picks scripts evenly; between groups the scheduler
    // shares, which gives nine times as much; three is still far outside the noise of a
    // ranking over hundreds of samples an interval.
    let heavy_each = heavy_cpu.as_secs_f64() / HEAVY as f64;
    let light_each = light_cpu.as_secs_f64() / (STATEMENTS - HEAVY) as f64;
    eprintln!(
        "backends' CPU: heavy {heavy_cpu:?} ({heavy_each:.2} s per statement), light {light_cpu:?} \
         ({light_each:.2} s per statement)"
    );
    ensure!(
        heavy_each >= 3.0 * light_each,
        "the heavy statements were not clearly heavier on this run: {heavy_each:.2} s of CPU \
         each, the light ones {light_each:.2} s each"
    );

    let ids: BTreeMap<usize, String> = (1..=STATEMENTS)
        .map(|i| Ok((i, pgss_queryid(&cluster, i)?)))
        .collect::<Result<_>>()?;
    let heavy: BTreeSet<String> = ids.range(..=HEAVY).map(|(_, id)| id.clone()).collect();
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

    // The weight under `other` is the light statements' (and pgscope's own catalog reads',
    // a few milliseconds an interval): their backends' share of the CPU, within 10 points.
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
    let sampled_share = other / labelled;
    let measured_share = light_cpu.as_secs_f64() / (light_cpu + heavy_cpu).as_secs_f64();
    eprintln!(
        "other: {:.1}% of the CPU samples under a queryid ({:.1} s of {:.1} s sampled); the light \
         backends: {:.1}% of the backends' CPU time",
        100.0 * sampled_share,
        other / 1e9,
        labelled / 1e9,
        100.0 * measured_share
    );
    ensure!(
        (sampled_share - measured_share).abs() <= 0.10,
        "`other` holds {:.1}% of the CPU samples, the light statements' backends had {:.1}% of \
         the backends' CPU time",
        100.0 * sampled_share,
        100.0 * measured_share
    );
    Ok(())
}
