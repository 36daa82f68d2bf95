//! The probes' overhead budget (`--probe-budget`, 2% of the instance's CPU by default): hot probes
//! are attached only part of the time, and their counts are estimated for the whole trace. The
//! estimates are checked against exact counts: Postgres' own (pg_stat_statements calls) and a
//! run that measures every call.

use anyhow::{ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// pgbench's `-S` statement as pg_stat_statements shows it under `-M prepared`.
const PGBENCH_SELECT: &str = "SELECT abalance FROM pgbench_accounts WHERE aid = $1";
/// Partitions of pgbench_accounts: a generic plan locks every one per execution.
const PARTITIONS: u32 = 16;

/// Executions of the select and the probes' summary of one traced pgbench run.
struct Run {
    executions: u64,
    summary: TraceSummary,
    queryid: String,
}

impl Run {
    fn calls(&self, function: &str) -> Result<u64> {
        Ok(self
            .summary
            .probe_of_query(&self.queryid, function)?
            .map_or(0, |s| s.calls))
    }
}

/// Traces the instance with `--probes all` under `budget` while `pgbench -S -M prepared` runs
/// for `seconds`, entirely inside the trace.
fn traced_run(cluster: &PgCluster, budget: &str, seconds: u32) -> Result<Run> {
    cluster.psql("SELECT pg_stat_statements_reset()")?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::instance(cluster.data_dir())
        .probes("all")
        .probe_budget(budget)
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    let report = cluster.pgbench(&[
        "-n",
        "-S",
        "-M",
        "prepared",
        "-c",
        "2",
        "-j",
        "2",
        "-T",
        &seconds.to_string(),
    ])?;
    let output = trace.interrupt()?;
    let rows = cluster.psql(&format!(
        "SELECT queryid, calls FROM pg_stat_statements WHERE toplevel AND query = '{PGBENCH_SELECT}'"
    ))?;
    let (queryid, executions) = rows
        .split_once('|')
        .with_context(|| format!("no pg_stat_statements entry for the select: `{rows}`"))?;
    let tps = report
        .lines()
        .find(|l| l.starts_with("tps"))
        .unwrap_or("no tps line");
    eprintln!("budget {budget}: {tps}");
    ensure!(
        output.stderr.contains(&format!(
            "probe budget {}",
            if budget == "none" { "none" } else { "2.0%" }
        )),
        "pgscope did not state the budget:\n{}",
        output.stderr
    );
    Ok(Run {
        executions: executions
            .trim()
            .parse()
            .with_context(|| format!("bad calls `{executions}`"))?,
        summary: TraceSummary::read(&json)?,
        queryid: queryid.to_owned(),
    })
}

fn within(estimate: u64, exact: f64, tolerance: f64) -> bool {
    (estimate as f64 - exact).abs() <= tolerance * exact
}

#[test]
fn budgeted_counts_are_within_ten_percent_of_exact_counts() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(
        &PgInstall::distro()?,
        &[("plan_cache_mode", "force_generic_plan")],
    )?;
    cluster.pgbench(&["-i", "-q", "-s", "1", &format!("--partitions={PARTITIONS}")])?;

    // Every call measured: how many relations one execution locks.
    let exact = traced_run(&cluster, "none", 3)?;
    let exact_locks = exact.calls("LockRelationOid")?;
    let locks_per_execution = exact_locks as f64 / exact.executions.max(1) as f64;
    eprintln!(
        "exact: {} executions, {exact_locks} LockRelationOid = {locks_per_execution:.2} per execution",
        exact.executions
    );
    ensure!(
        exact.executions >= 1000,
        "only {} executions in the exact run",
        exact.executions
    );

    // The default budget: LockRelationOid (~19 traps per execution) is far over 2% of the
    // instance's CPU, so it is attached a small part of the time and its count estimated.
    let budgeted = traced_run(&cluster, "2", 12)?;
    let lock_row = budgeted
        .summary
        .probes()?
        .into_iter()
        .find(|(f, _)| f == "LockRelationOid")
        .context("no LockRelationOid row under the budget")?;
    let share = budgeted.summary.attached_share("LockRelationOid")?;
    let extrapolated = budgeted.summary.extrapolated("LockRelationOid")?;
    let estimate = budgeted.calls("LockRelationOid")?;
    let expected = budgeted.executions as f64 * locks_per_execution;
    let plans = budgeted.calls("GetCachedPlan")?;
    eprintln!(
        "budget 2%: {} executions; LockRelationOid attached {:.1}% of the trace, estimated {estimate} \
         calls for the select (expected {expected:.0}: {:+.1}%), {} in all; GetCachedPlan estimated \
         {plans} ({:+.1}% of the executions)",
        budgeted.executions,
        share * 100.0,
        (estimate as f64 / expected - 1.0) * 100.0,
        lock_row.1.calls,
        (plans as f64 / budgeted.executions as f64 - 1.0) * 100.0
    );
    ensure!(
        extrapolated && share < 0.5,
        "LockRelationOid was not duty-cycled under the budget (attached {share:.2} of the trace)"
    );
    ensure!(
        within(estimate, expected, 0.10),
        "LockRelationOid estimate {estimate} is not within 10% of {expected:.0} \
         ({} executions × {locks_per_execution:.2} locks each)",
        budgeted.executions
    );
    // One cached plan per execution: the estimate against Postgres' own count.
    ensure!(
        within(plans, budgeted.executions as f64, 0.10),
        "GetCachedPlan estimate {plans} is not within 10% of the {} executions pg_stat_statements counted",
        budgeted.executions
    );
    Ok(())
}
