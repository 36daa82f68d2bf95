//! `--probes pgss_store`: pg_stat_statements' static store function, found through separate
//! debug files (the no-frame-pointer source build ships its libraries stripped, with a
//! build-id debug tree), counted per kind: one `exec` store per executed statement, plus one
//! `plan` store when `pg_stat_statements.track_planning` is on.

use anyhow::{ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// Statements executed while traced.
const STATEMENTS: u64 = 60;

fn stores_per_kind(track_planning: &str) -> Result<(u64, u64)> {
    let install = PgInstall::no_frame_pointers()?;
    let cluster = PgCluster::start_with_pg_stat_statements(
        &install,
        &[("pg_stat_statements.track_planning", track_planning)],
    )?;
    let mut connection = cluster.connect()?;
    // Warm this backend's catalog caches outside the trace.
    connection.query("SELECT 1")?;

    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::pid(connection.pid())
        .probes("pgss_store")
        .debug_dir(install.debug_dir.as_deref())
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    for i in 0..STATEMENTS {
        let answer = connection.query(&format!("SELECT {i} + 1"))?;
        ensure!(answer == (i + 1).to_string(), "statement {i} answered {answer}");
    }
    let output = trace.interrupt()?;
    ensure!(
        !output.stderr.contains("probe pgss_store not attached"),
        "pgss_store did not attach on the build with debug files:\n{}",
        output.stderr
    );
    connection.close()?;

    let summary = TraceSummary::read(&json)?;
    let calls = |kind: &str| -> Result<u64> {
        Ok(summary
            .probe(&format!("pgss_store({kind})"))?
            .map_or(0, |stats| stats.calls))
    };
    let (exec, plan) = (calls("exec")?, calls("plan")?);
    eprintln!("track_planning={track_planning}: pgss_store(exec) {exec}, pgss_store(plan) {plan} for {STATEMENTS} statements");
    Ok((exec, plan))
}

#[test]
fn one_exec_store_per_statement_and_a_plan_store_with_track_planning() -> Result<()> {
    require_root_and_bpf();
    let (exec, plan) = stores_per_kind("off").context("track_planning = off")?;
    ensure!(
        exec == STATEMENTS,
        "pgss_store(exec) counted {exec} times for {STATEMENTS} statements"
    );
    ensure!(
        plan == 0,
        "pgss_store(plan) counted {plan} times with track_planning off"
    );

    let (exec, plan) = stores_per_kind("on").context("track_planning = on")?;
    ensure!(
        exec == STATEMENTS,
        "pgss_store(exec) counted {exec} times for {STATEMENTS} statements"
    );
    ensure!(
        plan == STATEMENTS,
        "pgss_store(plan) counted {plan} times for {STATEMENTS} planned statements"
    );
    Ok(())
}

/// The distro build ships pg_stat_statements.so stripped and no debug file is installed here:
/// the probe is refused with what to install, and the other probes still run.
#[test]
fn distro_build_without_debug_file_says_what_to_install() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    let session = cluster.spawn_session(pgscope_tests::workload::CPU_BOUND)?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let output = Trace::pid(session.pid())
        .probes("pgss_store,PortalStart")
        .duration_secs(2)
        .json(&json)
        .output()?;
    ensure!(
        output.stderr.contains("probe pgss_store not attached")
            && output.stderr.contains("dbgsym")
            && output.stderr.contains("--debug-dir"),
        "expected the message naming the debug package and --debug-dir:\n{}",
        output.stderr
    );
    let summary = TraceSummary::read(&json)?;
    ensure!(
        summary.probe("PortalStart")?.is_some(),
        "the other probe was not attached"
    );
    Ok(())
}
