//! A uprobe is set on a file, not on a process: every instance running the same `postgres`
//! executable traps on a probe pgscope attaches for one of them. Those traps are counted, shown,
//! and charged to the probe budget, so that tracing a quiet instance cannot tax a busy
//! neighbour without limit.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use pgscope_tests::workload::MD5_BOUND;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// The probe budget of the trace: 0.5% of the traced instance's CPU (`--probe-budget 0.5`).
const BUDGET: f64 = 0.005;
/// What the duty cycle spends attached whatever the budget: its first window (half a second,
/// planned a quarter second in), a second window planned from the first's noisy rate (the rate
/// of a quarter second, while the trace starts), and switches at 50 ms ticks. With 750 ms, a
/// CI run came in at 9.8% against a bound of 8.6% (duty 3.7%, 1.5 s attached of 15.5 s);
/// before the probes were attached last, runs took 19-24% against bounds of 10-13%.
const UNBUDGETED: Duration = Duration::from_millis(1250);
/// Where the trace ends in the cycle: the duty is a mean over whole cycles (a window attached,
/// pgscope's `duty::WINDOW` of 500 ms, then off for the rest), and a trace only two or three cycles long that ends just
/// after a window holds up to one window more than its duration's share. At a duty of 7.5% a
/// cycle is 6.7 s, a 15.2 s trace 2.3 of them: a CI run came in at 16.1% against a bound of
/// 15.7% without this (2.45 s attached, 60 ms over).
const CYCLE_PHASE: Duration = Duration::from_millis(500);
/// How long the quiet instance runs its statements under the trace: long against the
/// unbudgeted first window (a 10 s trace came within 15% of the bound).
const WORKLOAD_SECONDS: &str = "15";
/// The least duty cycle pgscope plans (`MIN_DUTY`).
const MIN_DUTY: f64 = 0.02;

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
        .probe_budget(&(BUDGET * 100.0).to_string())
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    quiet.pgbench(&[
        "-n",
        "-S",
        "-M",
        "prepared",
        "-c",
        "1",
        "-R",
        "300",
        "-T",
        WORKLOAD_SECONDS,
    ])?;
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
        summary.extrapolated("PortalStart")?,
        "PortalStart was not duty-cycled although the neighbour's traps exceed the budget"
    );
    let allowed = budgeted_share(&summary, foreign, share)?;
    ensure!(
        share <= allowed,
        "PortalStart stayed attached {:.1}% of the trace; the budget allowed {:.1}%",
        share * 100.0,
        allowed * 100.0
    );
    // The quiet instance's own counts remain estimated from its own statements.
    ensure!(
        estimate as f64 >= 0.5 * executions as f64 && estimate as f64 <= 1.5 * executions as f64,
        "the estimate {estimate} is far from the {executions} executions of the quiet instance"
    );
    Ok(())
}

/// The share of the trace the budget allowed the probe to be attached, from what the same trace
/// measured: the traps while attached (the neighbour's and the instance's own) at the
/// calibrated cost per trap give the cost of full attachment, and the budget is a share of the
/// instance's CPU time (its on-CPU samples). On top of that come the duty cycle's unbudgeted
/// first plan and one window.
fn budgeted_share(summary: &TraceSummary, foreign: u64, share: f64) -> Result<f64> {
    let duration = summary.duration_seconds()?;
    let attached_s = (share * duration).max(1e-3);
    let traps = (foreign + summary.measured_calls("PortalStart")?) as f64;
    let full_cost_ns_per_s = traps / attached_s * summary.probe_ns_per_hit()?;
    let cpu_ns_per_s = summary.samples_profiled()? as f64 / summary.frequency_hz()? as f64 * 1e9 / duration;
    let duty = (BUDGET * cpu_ns_per_s / full_cost_ns_per_s).clamp(MIN_DUTY, 1.0);
    eprintln!(
        "full attachment costs {:.1} ms/s, the budget is {:.1} ms/s of the instance's {:.2} CPUs: duty {:.1}%",
        full_cost_ns_per_s / 1e6,
        BUDGET * cpu_ns_per_s / 1e6,
        cpu_ns_per_s / 1e9,
        duty * 100.0
    );
    Ok((duty + (UNBUDGETED + CYCLE_PHASE).as_secs_f64() / duration).min(1.0))
}
