//! A uprobe is set on a file, not on a process: every instance running the same `postgres`
//! executable traps on a probe pgscope attaches for one of them. Those traps are counted, shown,
//! and charged to the probe budget, so that tracing a quiet instance cannot tax a busy
//! neighbour without limit.

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::MD5_BOUND;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// pgbench's `-S` statement as pg_stat_statements shows it under `-M prepared`.
const PGBENCH_SELECT: &str = "SELECT abalance FROM pgbench_accounts WHERE aid = $1";

#[test]
fn traps_of_other_instances_are_counted_and_budgeted() -> Result<()> {
    require_root_and_bpf();
    let install = PgInstall::distro()?;
    let quiet = PgCluster::start_with_pg_stat_statements(&install, &[])?;
    let busy = PgCluster::start_beside(&install, &[], &quiet)?;
    for cluster in [&quiet, &busy] {
        cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    }
    // The busy neighbour runs the same executable flat out for the whole trace.
    let _neighbour = busy.spawn_pgbench(
        &["-n", "-S", "-M", "prepared", "-c", "2", "-j", "2", "-T", "600"],
        2,
    )?;
    // The traced instance burns a CPU in one long statement (the budget is a share of its CPU)
    // and runs few statements, so its own PortalStart traps are far under the budget.
    let _burner = quiet.spawn_session(MD5_BOUND)?;
    quiet.psql("SELECT pg_stat_statements_reset()")?;

    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    // 0.5% of a busy CPU is 5 ms/s: the quiet instance's own 300 statements a second cost a
    // tenth of it, the neighbour's thousands of traps a second more than all of it. Enough
    // statements fall in the probe's short windows (100 and more) for its counts to scale by
    // statements; with 20 a second they scaled by the instance's CPU, which the burner and the
    // saturated cores shift (estimates 0.58-1.66 times the executions).
    let trace = Trace::instance(quiet.data_dir())
        .probes("PortalStart")
        .probe_budget("0.5")
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    quiet.pgbench(&["-n", "-S", "-M", "prepared", "-c", "1", "-R", "300", "-T", "10"])?;
    let output = trace.interrupt()?;
    let summary = TraceSummary::read(&json)?;

    let foreign = summary
        .probe_hits_outside_trace("PortalStart")?
        .context("PortalStart has no count of traps outside the trace")?;
    let share = summary.attached_share("PortalStart")?;
    // The select's own estimate: the instance also runs pgscope's few catalog queries, each
    // measured once or not at all and so scaled up by the whole factor, which says nothing
    // about the select's.
    let select = quiet.pgbench_select_queryid()?;
    let estimate = summary
        .probe_of_query(&select, "PortalStart")?
        .map_or(0, |s| s.calls);
    let executions: u64 = quiet
        .psql(&format!(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query = '{PGBENCH_SELECT}'"
        ))?
        .trim()
        .parse()
        .context("pg_stat_statements' calls are not a number")?;
    eprintln!(
        "neighbour's traps {foreign}; PortalStart attached {:.1}% of the trace; estimated {estimate} calls \
         of the quiet instance's select, which ran {executions} times",
        share * 100.0
    );
    ensure!(
        foreign >= 1000,
        "only {foreign} traps of the busy neighbour were counted"
    );
    ensure!(
        output.stdout.contains("outside the trace"),
        "the summary does not say other processes hit the probes:\n{}",
        output.stdout
    );
    // The neighbour's traps cost more than the budget: the probe is duty-cycled, which it would
    // not be for the quiet instance's own calls.
    ensure!(
        summary.extrapolated("PortalStart")? && share < 0.5,
        "PortalStart stayed attached {:.0}% of the trace although the neighbour's traps exceed the budget",
        share * 100.0
    );
    // The quiet instance's own counts remain estimated from its own statements.
    ensure!(
        estimate as f64 >= 0.5 * executions as f64 && estimate as f64 <= 1.5 * executions as f64,
        "the estimate {estimate} is far from the {executions} executions of the quiet instance"
    );
    Ok(())
}
