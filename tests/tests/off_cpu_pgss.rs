//! Off-CPU time under pg_stat_statements eviction storms: with `pg_stat_statements.max` below
//! the number of distinct statements, every new entry evicts others under the extension's
//! exclusive LWLock, and backends queue on it (`LWLock:pg_stat_statements`, futex waits).

use anyhow::{ensure, Result};
use pgscope_tests::{require_root_and_bpf, workload, PgCluster, PgInstall, Trace};

/// Off-CPU time in pg_stat_statements' LWLock while 16 clients run 128 distinct statements,
/// with `pg_stat_statements.max` = `max`.
fn pgss_lock_wait_ns(max: &str) -> Result<(u64, u64)> {
    let cluster =
        PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[("pg_stat_statements.max", max)])?;
    let (_scripts, mut args) = workload::pgss_eviction_scripts(&cluster)?;
    args.extend(["-n", "-c", "16", "-j", "2", "-T", "8"].map(String::from));
    let trace = Trace::instance(cluster.data_dir()).off_cpu().spawn_summarized()?;
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let report = cluster.pgbench(&arg_refs)?;
    let (_, summary) = trace.finish()?;
    let dealloc = cluster.psql("SELECT dealloc FROM pg_stat_statements_info")?;
    let waits = summary.off_cpu_by_wait()?;
    let lock_ns: u64 = waits
        .iter()
        .filter(|w| w.wait_event == "LWLock:pg_stat_statements")
        .map(|w| w.ns)
        .sum();
    let client_ns: u64 = waits
        .iter()
        .filter(|w| w.backend_type == "client backend" && w.off_cpu != "idle")
        .map(|w| w.ns)
        .sum();
    let tps = report
        .lines()
        .find(|l| l.starts_with("tps"))
        .unwrap_or("no tps line");
    eprintln!(
        "pg_stat_statements.max = {max}: {:.1} ms off CPU in LWLock:pg_stat_statements of {:.1} ms \
         off CPU in client backends (not idle); dealloc {dealloc}; {tps}",
        lock_ns as f64 / 1e6,
        client_ns as f64 / 1e6
    );
    Ok((lock_ns, client_ns))
}

#[test]
fn pg_stat_statements_evictions_show_as_lwlock_waits() -> Result<()> {
    require_root_and_bpf();
    let (storm, storm_total) = pgss_lock_wait_ns("100")?;
    let (calm, calm_total) = pgss_lock_wait_ns("5000")?;
    let share = |ns: u64, total: u64| ns as f64 / total.max(1) as f64;
    ensure!(
        storm > 0,
        "no off-CPU time in LWLock:pg_stat_statements with 128 statements and max = 100"
    );
    ensure!(
        share(storm, storm_total) > 5.0 * share(calm, calm_total) && storm > 5 * calm,
        "LWLock:pg_stat_statements waits are not clearly larger with max = 100 ({storm} ns, {:.1}% of \
         client off-CPU time) than with max = 5000 ({calm} ns, {:.1}%)",
        100.0 * share(storm, storm_total),
        100.0 * share(calm, calm_total)
    );
    Ok(())
}
