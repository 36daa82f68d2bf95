//! Running child processes with a deadline, and polling instead of sleeping.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

/// How often [`wait_for`] re-checks its condition.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Calls `check` until it returns `Some`, or fails after `timeout` naming `what` was awaited.
/// Errors from `check` end the wait at once.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().with_context(|| format!("while waiting for {what}"))? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Renders a command line for error messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Spawns `cmd` with stdin closed and stdout/stderr captured, and collects its output. Kills it
/// and fails when it runs longer than `timeout`, so a hung child fails the test instead of
/// hanging it.
pub fn output_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<Output> {
    let line = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{line}`"))?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let status = match wait_timeout(&mut child, timeout)? {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{line}` did not finish within {timeout:?}");
        }
    };
    Ok(Output {
        status,
        stdout: join(stdout),
        stderr: join(stderr),
    })
}

/// Like [`output_with_timeout`], but a non-zero exit is an error carrying stderr; returns stdout.
pub fn run_checked(cmd: &mut Command, timeout: Duration) -> Result<String> {
    let line = describe(cmd);
    let out = output_with_timeout(cmd, timeout)?;
    if !out.status.success() {
        bail!(
            "`{line}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{line}` printed non-UTF-8 output"))
}

/// Waits for `child` to exit for at most `timeout`; `None` if it is still running.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().context("cannot wait for child process")? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Reads a child's pipe to its end on a thread of its own, so that a full pipe never blocks it.
pub(crate) fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> Option<thread::JoinHandle<Vec<u8>>> {
    pipe.map(|mut pipe| {
        thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            buf
        })
    })
}

/// What [`drain`] read (empty when the thread or pipe was missing).
pub(crate) fn join(handle: Option<thread::JoinHandle<Vec<u8>>>) -> Vec<u8> {
    handle.and_then(|h| h.join().ok()).unwrap_or_default()
}

/// `true` while a process with this pid exists (zombies included).
pub fn pid_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Pids of the live children of `parent`, read from `/proc/<pid>/stat`.
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| parent_of(pid) == Some(parent))
        .collect();
    children.sort_unstable();
    children
}

/// Parent pid of `pid`, `None` if it is gone.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain spaces and parentheses.
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(1)?.parse().ok()
}

/// CPU time (user + system) `pid` has used so far, from `/proc/PID/stat`: what the kernel
/// accounted to it, whatever share of the machine it was given.
pub fn cpu_time(pid: u32) -> Result<Duration> {
    // utime and stime.
    stat_cpu_time(pid, &[14, 15])
}

/// [`cpu_time`] with that of the children `pid` has waited for (`cutime`, `cstime`): for a
/// postmaster, the backends of connections already closed, whose own times end with them.
pub fn cpu_time_with_reaped_children(pid: u32) -> Result<Duration> {
    stat_cpu_time(pid, &[14, 15, 16, 17])
}

/// The sum of the clock-tick fields `fields` (1-based, as proc(5) numbers them) of
/// `/proc/PID/stat`.
fn stat_cpu_time(pid: u32, fields: &[usize]) -> Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("cannot read `{path}`"))?;
    // Fields from the state (field 3) on: the command name before them may hold spaces.
    let after_name: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let mut ticks = 0u64;
    for &field in fields {
        ticks += after_name
            .get(field - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .with_context(|| format!("`{path}` has no number in field {field}: `{stat}`"))?;
    }
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "sysconf(_SC_CLK_TCK) returned {per_second}");
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}
