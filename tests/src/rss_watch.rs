//! A process's resident memory sampled in the background: the highest `VmRSS` and `RssAnon`
//! seen, and the kernel's own high-water mark (`VmHWM`) when asked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{Context, Result};

const PERIOD: Duration = Duration::from_millis(100);

pub struct RssWatch {
    pid: u32,
    peak_kib: Arc<AtomicU64>,
    peak_anon_kib: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RssWatch {
    /// Samples `VmRSS` of `pid` every 100 ms until stopped or the process is gone.
    pub fn start(pid: u32) -> Self {
        let peak_kib = Arc::new(AtomicU64::new(0));
        let peak_anon_kib = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_peak, thread_anon, thread_samples, thread_stop) = (
            peak_kib.clone(),
            peak_anon_kib.clone(),
            samples.clone(),
            stop.clone(),
        );
        let thread = thread::spawn(move || {
            while !thread_stop.load(Ordering::Relaxed) {
                match status_kib(pid, "VmRSS").and_then(|rss| Ok((rss, status_kib(pid, "RssAnon")?))) {
                    Ok((kib, anon)) => {
                        thread_peak.fetch_max(kib, Ordering::Relaxed);
                        thread_anon.fetch_max(anon, Ordering::Relaxed);
                        thread_samples.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => return,
                }
                thread::sleep(PERIOD);
            }
        });
        Self {
            pid,
            peak_kib,
            peak_anon_kib,
            samples,
            stop,
            thread: Some(thread),
        }
    }

    /// The highest `VmRSS` sampled so far, in bytes, and how many samples were taken.
    pub fn peak_sampled(&self) -> (u64, u64) {
        (
            self.peak_kib.load(Ordering::Relaxed) * 1024,
            self.samples.load(Ordering::Relaxed),
        )
    }

    /// The highest `RssAnon` sampled so far, in bytes: the process's own memory (heap, stacks,
    /// BPF map copies), without the pages of its executable and libraries.
    pub fn peak_anon_sampled(&self) -> u64 {
        self.peak_anon_kib.load(Ordering::Relaxed) * 1024
    }

    /// `RssAnon` and `RssFile` now, in bytes.
    pub fn now(&self) -> Result<(u64, u64)> {
        Ok((
            status_kib(self.pid, "RssAnon")? * 1024,
            status_kib(self.pid, "RssFile")? * 1024,
        ))
    }

    /// The kernel's peak resident set of the process (`VmHWM`), in bytes.
    pub fn high_water_mark(&self) -> Result<u64> {
        Ok(status_kib(self.pid, "VmHWM")? * 1024)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A `kB` field of `/proc/<pid>/status`.
fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("process {pid} is gone"))?;
    status
        .lines()
        .find_map(|line| {
            let value = line.strip_prefix(field)?.strip_prefix(':')?;
            value.trim().trim_end_matches("kB").trim().parse().ok()
        })
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}
