//! User errors end with a non-zero exit and one clear sentence; no Postgres needed.

use std::process::{Child, Command, Output, Stdio};

use anyhow::{ensure, Context, Result};
use pgscope_tests::process::pid_exists;
use pgscope_tests::{require_root_and_bpf, run_pgscope};

/// clap's exit code for usage errors.
const USAGE_ERROR: i32 = 2;

#[test]
fn nonexistent_pid_is_named_in_the_error() -> Result<()> {
    require_root_and_bpf();
    let pid = unused_pid()?;
    let out = run_pgscope(["trace", "--pid", &pid.to_string(), "--duration", "1s"])?;
    let stderr = expect_one_sentence_failure(&out)?;
    ensure!(
        stderr.contains(&pid.to_string()),
        "the error does not mention pid {pid}: {stderr}"
    );
    Ok(())
}

#[test]
fn non_postgres_process_is_refused() -> Result<()> {
    require_root_and_bpf();
    let sleeper = Sleeper::spawn()?;
    let out = run_pgscope(["trace", "--pid", &sleeper.pid().to_string(), "--duration", "1s"])?;
    let stderr = expect_one_sentence_failure(&out)?;
    ensure!(
        stderr.to_lowercase().contains("not a postgres"),
        "the error does not say pid {} (sleep) is not a Postgres process: {stderr}",
        sleeper.pid()
    );
    Ok(())
}

#[test]
fn zero_duration_is_a_usage_error() -> Result<()> {
    expect_usage_error(&["trace", "--pid", "1", "--duration", "0s"], "--duration")
}

#[test]
fn garbage_duration_is_a_usage_error() -> Result<()> {
    expect_usage_error(&["trace", "--pid", "1", "--duration", "soon"], "--duration")
}

#[test]
fn missing_target_is_a_usage_error() -> Result<()> {
    expect_usage_error(&["trace", "--duration", "1s"], "")
}

#[test]
fn pid_and_instance_together_are_a_usage_error() -> Result<()> {
    expect_usage_error(
        &["trace", "--pid", "1", "--instance", "1", "--duration", "1s"],
        "",
    )
}

/// Fails unless `out` is a failure whose stderr is one line, not a panic. Returns stderr.
fn expect_one_sentence_failure(out: &Output) -> Result<String> {
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    ensure!(
        !out.status.success(),
        "pgscope succeeded; stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    ensure!(!stderr.contains("panicked"), "pgscope panicked: {stderr}");
    ensure!(
        !stderr.is_empty() && stderr.lines().count() == 1,
        "expected one sentence on stderr, got:\n{stderr}"
    );
    Ok(stderr)
}

/// Fails unless `args` make clap reject the command line (exit 2, `error:` on stderr,
/// mentioning `flag` if not empty).
fn expect_usage_error(args: &[&str], flag: &str) -> Result<()> {
    let out = run_pgscope(args)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(USAGE_ERROR),
        "`pgscope {}` exited with {} instead of the usage error {USAGE_ERROR}; stderr:\n{stderr}",
        args.join(" "),
        out.status
    );
    ensure!(stderr.starts_with("error:"), "not a clap error: {stderr}");
    ensure!(
        stderr.contains(flag),
        "the error does not mention `{flag}`: {stderr}"
    );
    Ok(())
}

/// A pid no process has: counting down from the top of the pid space, where the kernel
/// allocates last.
fn unused_pid() -> Result<u32> {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")?
        .trim()
        .parse()?;
    (2..max)
        .rev()
        .find(|&pid| !pid_exists(pid))
        .context("every pid is in use")
}

/// A `sleep 60` child, killed on drop.
struct Sleeper(Child);

impl Sleeper {
    fn spawn() -> Result<Self> {
        let child = Command::new("sleep")
            .arg("60")
            .stdin(Stdio::null())
            .spawn()
            .context("cannot start `sleep 60`")?;
        Ok(Sleeper(child))
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How long refusing a file that is not one may take: reading `/dev/zero` used to never end.
const REFUSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs `pgscope <args>`, failing if it has not exited within [`REFUSE_TIMEOUT`].
fn run_bounded(args: &[&str]) -> Result<Output> {
    let mut command = pgscope_tests::pgscope::pgscope_command(args)?;
    pgscope_tests::process::output_with_timeout(&mut command, REFUSE_TIMEOUT)
        .with_context(|| format!("`pgscope {}` hung reading a file that never ends", args.join(" ")))
}

#[test]
fn a_recording_that_is_not_a_regular_file_is_refused_at_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out_path = dir.path().join("report.html");
    let out_arg = out_path.to_string_lossy();
    let out = run_bounded(&["report", "--from", "/dev/zero", "--out", &out_arg])?;
    let stderr = expect_one_sentence_failure(&out)?;
    ensure!(
        stderr.contains("`/dev/zero` is a character device, not a regular file"),
        "the error does not say what /dev/zero is: {stderr}"
    );
    let dir_arg = dir.path().to_string_lossy();
    let out = run_bounded(&["report", "--from", &dir_arg, "--out", &out_arg])?;
    let stderr = expect_one_sentence_failure(&out)?;
    ensure!(stderr.contains("is a directory"), "{stderr}");
    Ok(())
}

#[test]
fn an_oversize_recording_is_refused_with_its_size_and_the_limit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("huge.json");
    // Sparse: 2 GiB long, no disk used.
    std::fs::File::create(&path)?.set_len(2 << 30)?;
    let out_path = dir.path().join("report.html");
    let out = run_bounded(&[
        "report",
        "--from",
        &path.to_string_lossy(),
        "--out",
        &out_path.to_string_lossy(),
    ])?;
    let stderr = expect_one_sentence_failure(&out)?;
    ensure!(
        stderr.contains("is 2 GiB, over the 1 GiB limit"),
        "the error does not give the size and the limit: {stderr}"
    );
    Ok(())
}

#[test]
fn a_config_that_is_not_a_regular_file_is_refused_at_once() -> Result<()> {
    let out = run_bounded(&["agent", "--config", "/dev/zero", "--check-config"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(USAGE_ERROR),
        "exit {} instead of {USAGE_ERROR} (invalid configuration): {stderr}",
        out.status
    );
    ensure!(
        stderr.contains("the config file `/dev/zero` is a character device, not a regular file"),
        "the error does not say what /dev/zero is: {stderr}"
    );
    Ok(())
}

#[test]
fn a_pid_file_that_is_not_a_regular_file_is_refused_at_once() -> Result<()> {
    // A data directory whose postmaster.pid is a FIFO nobody writes: reading it used to wait
    // forever.
    let dir = tempfile::tempdir()?;
    let fifo = dir.path().join("postmaster.pid");
    let c_path = std::ffi::CString::new(fifo.to_string_lossy().as_bytes())?;
    // SAFETY: c_path is a valid NUL-terminated path for the duration of the call.
    ensure!(
        unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) } == 0,
        "mkfifo failed"
    );
    let dir_arg = dir.path().to_string_lossy();
    let out = run_bounded(&["trace", "--instance", &dir_arg, "--duration", "1s"])?;
    let stderr = expect_one_sentence_failure(&out)?;
    ensure!(
        stderr.contains("is a FIFO, not a regular file"),
        "the error does not say what the pid file is: {stderr}"
    );
    Ok(())
}
