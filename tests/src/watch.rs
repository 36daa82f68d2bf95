//! Remembering every process a cluster had while something ran: `--instance` may attribute
//! samples to processes that exit before the test looks (or that the test never saw start).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use anyhow::{bail, Result};

use crate::cluster::PgCluster;
use crate::fork_events::{ForkEvents, Received};
use crate::process::children_of;

/// How long one wait for events lasts: how soon a stop is noticed.
const RECEIVE_TIMEOUT: Duration = Duration::from_millis(20);

/// A background thread following the kernel's fork events from the postmaster and its
/// descendants. Listing `/proc` every 2 ms still missed a backend that lived less than that
/// (CI, twice): pgscope's own connections are short backends of the cluster that can be sampled.
pub struct ProcessWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<BTreeSet<u32>>>>,
}

impl PgCluster {
    /// Starts recording the postmaster and every process it (or a child of it) forks from now
    /// on, with its children of the moment.
    pub fn watch_processes(&self) -> Result<ProcessWatch> {
        let postmaster = self.postmaster_pid()?;
        // Subscribed before the listing: a child forked in between is in one or the other.
        let events = ForkEvents::subscribe(RECEIVE_TIMEOUT)?;
        let mut seen = BTreeSet::from([postmaster]);
        seen.extend(children_of(postmaster));
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || loop {
            match events.receive()? {
                Received::Forks(forks) => {
                    for fork in forks {
                        if seen.contains(&fork.parent_tgid) {
                            seen.insert(fork.child_tgid);
                        }
                    }
                }
                Received::Nothing => {}
                Received::Overflowed => bail!(
                    "the kernel dropped process events (the watcher's buffer overflowed): the \
                     cluster's processes are not all known"
                ),
            }
            if flag.load(Ordering::Relaxed) {
                return Ok(seen);
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
    pub fn stop(mut self) -> Result<BTreeSet<u32>> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => bail!("the process watcher panicked"),
            None => bail!("the process watcher was already stopped"),
        }
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
