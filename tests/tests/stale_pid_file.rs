//! `--instance DATA_DIR` trusts `postmaster.pid` only once its PID is proven to be that data
//! directory's postmaster: a pid file left by a crash names a PID that may now be another
//! process, even the postmaster of another instance.

use std::fs;

use anyhow::{ensure, Context, Result};
use pgscope_tests::{require_root_and_bpf, run_pgscope, PgCluster, PgInstall};

/// A copy of a running instance's pid file in another (stopped) data directory names a live
/// postmaster of the wrong instance: pgscope must refuse it, not profile the other instance.
#[test]
fn pid_file_naming_another_instances_postmaster_is_refused() -> Result<()> {
    require_root_and_bpf();
    let running = PgCluster::start(&PgInstall::distro()?)?;
    let stopped = tempfile::tempdir()?;
    let pid_file = fs::read_to_string(running.data_dir().join("postmaster.pid"))?;
    fs::write(stopped.path().join("postmaster.pid"), &pid_file)?;
    fs::write(stopped.path().join("PG_VERSION"), "15\n")?;

    let out = run_pgscope([
        "trace",
        "--instance",
        stopped.path().to_str().context("temp dir path is not UTF-8")?,
        "--duration",
        "1s",
    ])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "pgscope profiled postmaster {} through a stale pid file; stderr:\n{stderr}",
        running.postmaster_pid()?
    );
    ensure!(
        stderr.contains("stale") && stderr.contains(&running.postmaster_pid()?.to_string()),
        "the error does not say the pid file is stale and which PID it names:\n{stderr}"
    );
    ensure!(!stderr.contains("panicked"), "pgscope panicked:\n{stderr}");

    // The instance's own data directory is still accepted.
    let out = run_pgscope([
        "trace",
        "--instance",
        running
            .data_dir()
            .to_str()
            .context("data dir path is not UTF-8")?,
        "--duration",
        "1s",
    ])?;
    ensure!(
        out.status.success(),
        "the running instance's own data directory was refused:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
