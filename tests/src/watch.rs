//! Remembering every process a cluster had while something ran: `--instance` may attribute
//! samples to processes that exit before the test looks (or that the test never saw start).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::Result;

use crate::cluster::PgCluster;
use crate::process::children_of;

/// How often the children are listed. pgscope's own connections (its counters at the start,
/// its blocker polls) are backends of the cluster that can live a few tens of milliseconds and
/// be sampled: at 20 ms one was missed and its samples taken for another cluster's (CI,
/// 2026-11-29). A listing reads one small /proc file.
const WATCH_INTERVAL: Duration = Duration::from_millis(2);

/// A background thread listing the postmaster's children every [`WATCH_INTERVAL`].
pub struct ProcessWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<BTreeSet<u32>>>,
}

impl PgCluster {
    /// Starts recording the postmaster and every child it has from now on.
    pub fn watch_processes(&self) -> Result<ProcessWatch> {
        let postmaster = self.postmaster_pid()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut seen = BTreeSet::from([postmaster]);
            loop {
                seen.extend(children_of(postmaster));
                if flag.load(Ordering::Relaxed) {
                    return seen;
                }
                thread::sleep(WATCH_INTERVAL);
            }
        });
        Ok(ProcessWatch {
            stop,
            thread: Some(thread),
        })
    }
}

impl ProcessWatch {
    /// Stops watching; returns every pid seen (postmaster included).
    pub fn stop(mut self) -> BTreeSet<u32> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for ProcessWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
