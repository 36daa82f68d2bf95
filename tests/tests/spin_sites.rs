//! `--probes s_lock`: every spinlock acquisition that has to spin calls `s_lock(lock, file, line,
//! func)`; pgscope names the call site from those arguments, read in the backend's memory.

use anyhow::{bail, ensure, Result};
use pgscope_tests::probe_matrix::SPIN_SITES;
use pgscope_tests::probe_workloads::{trace_backend, BackendWorkload};
use pgscope_tests::spin_calls::decoded;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// Two calls with known arguments come back as two call sites with exactly those names and
/// lines, one call each.
#[test]
fn call_sites_are_named_from_the_arguments() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let workload = BackendWorkload {
        spin_sites: SPIN_SITES,
        ..BackendWorkload::default()
    };
    let traced = trace_backend(&cluster, workload, |trace| trace.probes("s_lock"))?;
    let (read, wrong) = traced.spin_sites()?;
    eprintln!("call sites read back: {read:?}");
    if let Some(wrong) = wrong {
        bail!("{wrong} (all sites: {:?})", traced.summary.spin_sites()?);
    }
    Ok(())
}

/// Real contention: 8 clients running the same prepared select all update the same
/// pg_stat_statements entry under its spinlock (SpinLockAcquire(&e->mutex) in pgss_store), on
/// 2 cores. The sites come back as Postgres source locations.
#[test]
fn contended_spinlocks_under_pgbench_are_source_locations() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start_with_pg_stat_statements(&PgInstall::distro()?, &[])?;
    cluster.pgbench(&["-i", "-q", "-s", "1"])?;
    let postmaster = cluster.postmaster_pid()?;
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::instance(postmaster.to_string())
        .probes("s_lock")
        .probe_budget("none")
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    let pgbench = cluster.spawn_pgbench(
        &["-n", "-S", "-M", "prepared", "-c", "8", "-j", "2", "-T", "600"],
        8,
    )?;
    std::thread::sleep(std::time::Duration::from_secs(6));
    pgbench.stop()?;
    trace.interrupt()?;

    let sites = TraceSummary::read(&json)?.spin_sites()?;
    for site in &sites {
        eprintln!(
            "{}:{} ({}) queryid {}: {} calls, {:.2} ms",
            site.file,
            site.line,
            site.function,
            site.queryid,
            site.calls,
            site.total_ns as f64 / 1e6
        );
    }
    if sites.is_empty() {
        bail!("no s_lock call in 6 s of 8 clients on one pg_stat_statements entry");
    }
    for site in &sites {
        ensure!(
            decoded(site),
            "call site not decoded to a source location: {site:?}"
        );
    }
    Ok(())
}
