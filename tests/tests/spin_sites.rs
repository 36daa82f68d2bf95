//! `--probes s_lock`: every spinlock acquisition that has to spin calls `s_lock(lock, file, line,
//! func)`; pgscope names the call site from those arguments, read in the backend's memory.

use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use pgscope_tests::summary::SpinSite;
use pgscope_tests::{require_root_and_bpf, PgCluster, PgInstall, Trace, TraceSummary};

/// Makes backend `pid` call `s_lock` on a free lock of its own (fresh zeroed memory, so that no
/// real lock of the instance is touched) with call-site arguments the test chooses: a real call
/// with known arguments. A free lock is taken at once, so s_lock returns immediately.
fn call_s_lock_in(pid: u32, file: &str, line: u32, function: &str) -> Result<()> {
    let call = format!(
        "call ((int(*)(void *, const char *, int, const char *)) s_lock)($lock, \"{file}\", {line}, \"{function}\")"
    );
    let output = Command::new("gdb")
        .args(["-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set $lock = (void *) calloc(1, 8)", "-ex", &call])
        .output()
        .context("cannot run gdb (scripts/install-deps.sh installs it)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success() && stdout.contains("= 0"),
        "gdb could not call s_lock in backend {pid}:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

fn sites_named<'a>(sites: &'a [SpinSite], file: &str) -> Vec<&'a SpinSite> {
    sites.iter().filter(|s| s.file == file).collect()
}

/// Two calls with known arguments come back as two call sites with exactly those names and
/// lines, one call each.
#[test]
fn call_sites_are_named_from_the_arguments() -> Result<()> {
    require_root_and_bpf();
    let cluster = PgCluster::start(&PgInstall::distro()?)?;
    let mut connection = cluster.connect()?;
    let pid = connection.pid();
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("summary.json");
    let trace = Trace::pid(pid)
        .probes("s_lock")
        .probe_budget("none")
        .duration_secs(600)
        .json(&json)
        .spawn()?;
    call_s_lock_in(pid, "pgscope_test.c", 4242, "first_site")?;
    call_s_lock_in(pid, "pgscope_test.c", 4343, "second_site")?;
    trace.interrupt()?;
    // The backend goes on serving its client.
    ensure!(
        connection.query("SELECT 40 + 2")? == "42",
        "the backend misbehaved after the calls"
    );
    connection.close()?;

    let sites = TraceSummary::read(&json)?.spin_sites()?;
    let mut ours: Vec<(u32, &str, u64)> = sites_named(&sites, "pgscope_test.c")
        .iter()
        .map(|s| (s.line, s.function.as_str(), s.calls))
        .collect();
    ours.sort();
    ensure!(
        ours == [(4242, "first_site", 1), (4343, "second_site", 1)],
        "expected one call at each of the two sites, got {ours:?} (all sites: {sites:?})"
    );
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
            site.file.ends_with(".c")
                && site.line > 0
                && !site.function.is_empty()
                && !site.function.starts_with("0x"),
            "call site not decoded to a source location: {site:?}"
        );
    }
    Ok(())
}
