//! `pgscope agent` diagnoses what it ships: each instance's findings over each upload interval
//! appear on /metrics as `pgscope_finding` series and in the log when they change. A workload
//! whose inserts do most of their work in a trigger deferred to commit must raise the commit
//! phase finding for the insert's queryid while it runs, and clear it once it stops.

use std::time::Duration;

use anyhow::{ensure, Result};
use pgscope_tests::{require_root_and_bpf, wait_for, PgCluster, PgInstall, PyroscopeCapture, RunningAgent};

const INSTANCE: &str = "pgscope_findings";

/// The `pgscope_finding` line of the commit phase finding for `queryid`, if /metrics has it.
fn commit_finding(metrics: &str, queryid: &str) -> Option<String> {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("pgscope_finding{")
                && l.contains(&format!("instance=\"{INSTANCE}\""))
                && l.contains("kind=\"phase_dominance\"")
                && l.contains(&format!("queryid=\"{queryid}\""))
        })
        .map(str::to_string)
}

#[test]
fn a_finding_appears_on_metrics_and_in_the_log_while_its_workload_runs_and_clears_after() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with(
        &PgInstall::distro()?,
        &[
            ("shared_preload_libraries", "pg_stat_statements"),
            ("cluster_name", INSTANCE),
        ],
    )?;
    cluster.psql("CREATE EXTENSION pg_stat_statements")?;
    cluster.psql("CREATE TABLE t (x int)")?;
    cluster.psql(
        "CREATE FUNCTION heavy() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN PERFORM sum(i) FROM generate_series(1, 20000) i; RETURN NULL; END$$",
    )?;
    cluster.psql(
        "CREATE CONSTRAINT TRIGGER heavy AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED \
         FOR EACH ROW EXECUTE FUNCTION heavy()",
    )?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("insert.sql");
    std::fs::write(&script, "INSERT INTO t VALUES (1);\n")?;

    let capture = PyroscopeCapture::start()?;
    let config = format!(
        "[pyroscope]\nurl = \"{}\"\n[collection]\nupload_interval = \"2s\"\n\
         [[discovery.include]]\ndata_dir = \"{}\"\n",
        capture.url(),
        cluster.data_dir().display()
    );
    let agent = RunningAgent::start(&config, &[])?;
    agent.wait_metric(
        "pgscope_instances",
        "the instance",
        Duration::from_secs(30),
        |n| n >= 1.0,
    )?;

    let script = script.display().to_string();
    let queryid = std::thread::scope(|scope| -> Result<String> {
        let load = scope.spawn(|| cluster.pgbench(&["-n", "-c", "2", "-j", "2", "-T", "8", "-f", &script]));
        // The insert's queryid, once pg_stat_statements has it.
        let queryid = wait_for(
            "the insert in pg_stat_statements",
            Duration::from_secs(20),
            || {
                let id = cluster
                    .psql("SELECT queryid FROM pg_stat_statements WHERE query LIKE 'INSERT INTO t%'")?;
                Ok(Some(id.trim().to_string()).filter(|id| !id.is_empty()))
            },
        )?;
        let line = wait_for(
            "the commit phase finding on /metrics",
            Duration::from_secs(20),
            || {
                let (_, metrics) = agent.get("/metrics")?;
                Ok(commit_finding(&metrics, &queryid))
            },
        );
        load.join()
            .map_err(|_| anyhow::anyhow!("pgbench thread panicked"))??;
        let line = line.map_err(|error| anyhow::anyhow!("{error:#}\nagent log:\n{}", agent.log()))?;
        // Most of the insert's CPU is the deferred trigger's: a warning or worse (at 19 Hz an
        // interval holds few samples, so which of the two varies).
        ensure!(
            (line.contains("severity=\"critical\"") || line.contains("severity=\"warning\""))
                && line.ends_with(" 1"),
            "{line}"
        );
        Ok(queryid)
    })?;
    let log = agent.log();
    ensure!(
        log.lines()
            .any(|l| l.contains("finding: queryid") && l.contains(&queryid) && l.contains("in commit")),
        "the finding's appearance is not in the log:\n{log}"
    );

    // The load has stopped: the next interval has no such statement, and the finding clears.
    wait_for(
        "the finding to clear from /metrics",
        Duration::from_secs(20),
        || {
            let (_, metrics) = agent.get("/metrics")?;
            Ok(commit_finding(&metrics, &queryid).is_none().then_some(()))
        },
    )?;
    let log = agent.log();
    ensure!(
        log.lines()
            .any(|l| l.contains("finding cleared") && l.contains(&queryid)),
        "the finding's clearing is not in the log:\n{log}"
    );
    let appearances = log
        .lines()
        .filter(|l| l.contains(&format!("finding: queryid {queryid} ")) && l.contains("in commit"))
        .count();
    ensure!(
        appearances == 1,
        "an unchanged finding must be logged once, not every interval ({appearances} times):\n{log}"
    );
    let evaluated = agent.metric("pgscope_findings_evaluated_total")?;
    ensure!(evaluated >= 3.0, "{evaluated} intervals evaluated");
    let (status, _) = agent.terminate()?;
    ensure!(status.success(), "the agent exited with {status}");
    Ok(())
}
