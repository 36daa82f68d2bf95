//! A `pgscope trace` running in the background while the test drives the workload, ended with
//! SIGINT: pgscope stops early on it and still writes every output.

use std::io::{BufRead, BufReader};
use std::process::{Child, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::pgscope::{Trace, TraceOutput, RUN_TIMEOUT};
use crate::process::{describe, drain, join, wait_for, wait_timeout};

/// What pgscope prints on stderr once its probes are attached and sampling runs.
const PROFILING: &str = "pgscope: profiling ";
/// Loading BPF, resolving symbols and attaching probes takes a few seconds at most.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);

/// A `pgscope trace` the test does not wait for. Dropping it kills pgscope.
pub struct RunningTrace {
    child: Child,
    line: String,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Arc<Mutex<String>>,
    stderr_thread: Option<JoinHandle<()>>,
}

impl Trace {
    /// Starts the trace and returns once pgscope says it is profiling, i.e. its probes are
    /// attached. Give it a `--duration` longer than what the test does meanwhile, and end it
    /// with [`RunningTrace::interrupt`].
    pub fn spawn(&self) -> Result<RunningTrace> {
        let mut cmd = self.command()?;
        let line = describe(&cmd);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start `{line}`"))?;
        let stdout = drain(child.stdout.take());
        let stderr = Arc::new(Mutex::new(String::new()));
        let stderr_thread = child.stderr.take().map(|pipe| {
            let sink = Arc::clone(&stderr);
            thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut text = sink.lock().unwrap_or_else(|e| e.into_inner());
                    text.push_str(&line);
                    text.push('\n');
                }
            })
        });
        let mut trace = RunningTrace {
            child,
            line,
            stdout,
            stderr,
            stderr_thread,
        };
        trace.wait_profiling()?;
        Ok(trace)
    }
}

impl RunningTrace {
    /// Sends SIGINT and waits for pgscope to write its outputs and exit; fails on a non-zero exit.
    pub fn interrupt(self) -> Result<TraceOutput> {
        let line = self.line.clone();
        TraceOutput::checked(&line, self.stop_with(libc::SIGINT)?)
    }

    /// Sends `signal` and waits for pgscope to exit, whatever its exit status.
    pub fn stop_with(mut self, signal: libc::c_int) -> Result<Output> {
        // SAFETY: plain kill(2) on our own child, which has not been reaped (we hold it).
        if unsafe { libc::kill(self.child.id() as libc::pid_t, signal) } != 0 {
            bail!(
                "cannot send signal {signal} to `{}`: {}",
                self.line,
                std::io::Error::last_os_error()
            );
        }
        let Some(status) = wait_timeout(&mut self.child, RUN_TIMEOUT)? else {
            bail!(
                "`{}` did not exit within {RUN_TIMEOUT:?} of signal {signal}",
                self.line
            );
        };
        let stdout = join(self.stdout.take());
        if let Some(t) = self.stderr_thread.take() {
            let _ = t.join();
        }
        Ok(Output {
            status,
            stdout,
            stderr: self.stderr_text().into_bytes(),
        })
    }

    fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn wait_profiling(&mut self) -> Result<()> {
        let line = self.line.clone();
        wait_for(&format!("`{line}` to start profiling"), ATTACH_TIMEOUT, || {
            if self.stderr_text().contains(PROFILING) {
                return Ok(Some(()));
            }
            if let Some(status) = self.child.try_wait()? {
                if let Some(t) = self.stderr_thread.take() {
                    let _ = t.join();
                }
                bail!(
                    "`{line}` exited ({status}) before it profiled:\n{}",
                    self.stderr_text().trim()
                );
            }
            Ok(None)
        })
    }
}

impl Drop for RunningTrace {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A [`RunningTrace`] writing its JSON summary into a directory of its own.
pub struct SummarizedTrace {
    running: RunningTrace,
    json: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Trace {
    /// Starts the trace with `--json` into a fresh temporary directory and a duration longer
    /// than any test; end it with [`SummarizedTrace::finish`].
    pub fn spawn_summarized(self) -> Result<SummarizedTrace> {
        let dir = tempfile::tempdir().context("cannot create a directory for the summary")?;
        let json = dir.path().join("summary.json");
        let running = self.duration_secs(600).json(&json).spawn()?;
        Ok(SummarizedTrace {
            running,
            json,
            _dir: dir,
        })
    }
}

impl SummarizedTrace {
    /// Interrupts the trace and reads its summary.
    pub fn finish(self) -> Result<(TraceOutput, crate::TraceSummary)> {
        let output = self.running.interrupt()?;
        let summary = crate::TraceSummary::read(&self.json)?;
        Ok((output, summary))
    }
}
