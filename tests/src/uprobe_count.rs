//! Calls of a function counted by perf's own uprobe (`perf probe` + `perf stat`): a count taken
//! by another tool than pgscope, for figures a finding cites. The event is added under a name of
//! this process's own, so that tests of other engineers on the machine do not collide with it,
//! and removed on drop.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::{output_with_timeout, run_checked, wait_timeout};

/// `perf probe` reads the binary's symbols; `perf stat` lasts the window asked plus this.
const PERF_TIMEOUT: Duration = Duration::from_secs(120);

/// A uprobe event in the kernel's tracefs, removed on drop.
pub struct UprobeEvent {
    /// `group:name`, as `perf stat -e` takes it.
    event: String,
    /// The filter `perf stat --filter` applies to each hit, if any.
    filter: Option<String>,
}

impl UprobeEvent {
    /// A uprobe on `function` of `binary`, fetching `fetch` (perf probe's argument syntax, e.g.
    /// `file=+0(%si):string` for a string second argument) when given.
    pub fn add(binary: &Path, function: &str, fetch: Option<&str>) -> Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let event = format!(
            "pgscope_tests:{function}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let spec = match fetch {
            Some(fetch) => format!("{event}={function} {fetch}"),
            None => format!("{event}={function}"),
        };
        let mut cmd = Command::new("perf");
        cmd.args(["probe", "-q", "-x"]).arg(binary).args(["-a", &spec]);
        run_checked(&mut cmd, PERF_TIMEOUT).with_context(|| {
            format!(
                "cannot add a perf uprobe on `{function}` of `{}`",
                binary.display()
            )
        })?;
        Ok(Self { event, filter: None })
    }

    /// Counts only hits matching `filter` (`perf stat --filter`, over the fetched arguments).
    pub fn filtered(mut self, filter: &str) -> Self {
        self.filter = Some(filter.to_owned());
        self
    }

    /// Hits by the processes `pids` over `window`.
    pub fn count_in(&self, pids: &[u32], window: Duration) -> Result<u64> {
        if pids.is_empty() {
            bail!("no process to count `{}` in", self.event);
        }
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let mut cmd = Command::new("perf");
        cmd.args(["stat", "-x", ",", "-e", &self.event]);
        if let Some(filter) = &self.filter {
            cmd.args(["--filter", filter]);
        }
        cmd.args(["-p", &pids.join(","), "--", "sleep"])
            .arg(format!("{}", window.as_secs_f64()));
        let output = output_with_timeout(&mut cmd, window + PERF_TIMEOUT)?;
        // perf stat writes its counts to stderr: `count,,event,…`.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let line = stderr
            .lines()
            .find(|l| l.contains(&self.event))
            .with_context(|| format!("perf stat printed no count of `{}`: {stderr}", self.event))?;
        let count = line.split(',').next().unwrap_or_default();
        count
            .parse()
            .with_context(|| format!("perf stat counted `{count}` hits of `{}`: {line}", self.event))
    }
}

impl UprobeEvent {
    /// Starts counting hits by the processes `pids` from now until [`LiveCount::stop`], the
    /// count so far readable meanwhile: a test waits for the hits it needs instead of counting
    /// over a fixed window.
    pub fn count_live(&self, pids: &[u32]) -> Result<LiveCount> {
        if pids.is_empty() {
            bail!("no process to count `{}` in", self.event);
        }
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let mut cmd = Command::new("perf");
        // One line per interval, `seconds,count,unit,event,…`, on stderr.
        cmd.args(["stat", "-I", "200", "-x", ",", "-e", &self.event]);
        if let Some(filter) = &self.filter {
            cmd.args(["--filter", filter]);
        }
        cmd.args(["-p", &pids.join(",")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot count `{}` with perf stat", self.event))?;
        let total = Arc::new(AtomicU64::new(0));
        let reader = child.stderr.take().map(|pipe| {
            let (total, event) = (Arc::clone(&total), self.event.clone());
            std::thread::spawn(move || {
                let mut unparsed = String::new();
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if !line.contains(&event) {
                        unparsed.push_str(&line);
                        unparsed.push('\n');
                        continue;
                    }
                    // `<not counted>` when the processes did not run in the interval.
                    let count = line.split(',').nth(1).and_then(|c| c.parse::<u64>().ok());
                    total.fetch_add(count.unwrap_or(0), Ordering::Relaxed);
                }
                unparsed
            })
        });
        Ok(LiveCount {
            child,
            total,
            reader,
            event: self.event.clone(),
        })
    }
}

/// A `perf stat` counting an event's hits until stopped.
pub struct LiveCount {
    child: Child,
    total: Arc<AtomicU64>,
    reader: Option<JoinHandle<String>>,
    event: String,
}

impl LiveCount {
    /// Hits counted so far (perf reports every 200 ms).
    pub fn so_far(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Stops counting (SIGINT: perf reports the last interval) and returns the hits counted.
    pub fn stop(mut self) -> Result<u64> {
        // SAFETY: plain kill(2) on our own child, which has not been reaped (we hold it).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGINT) };
        let status = wait_timeout(&mut self.child, PERF_TIMEOUT)?;
        let unparsed = self
            .reader
            .take()
            .and_then(|reader| reader.join().ok())
            .unwrap_or_default();
        // Interrupted, perf stat exits with the signal's status: only its not exiting is wrong.
        if status.is_none() {
            bail!("perf stat counting `{}` did not stop: {unparsed}", self.event);
        }
        if self.so_far() == 0 && !unparsed.trim().is_empty() {
            eprintln!("perf stat counting `{}` said: {}", self.event, unparsed.trim());
        }
        Ok(self.so_far())
    }
}

impl Drop for LiveCount {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for UprobeEvent {
    fn drop(&mut self) {
        let mut cmd = Command::new("perf");
        cmd.args(["probe", "-q", "-d", &self.event]);
        if let Err(e) = run_checked(&mut cmd, PERF_TIMEOUT) {
            eprintln!("cannot remove the perf uprobe `{}`: {e:#}", self.event);
        }
    }
}
