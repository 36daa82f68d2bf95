//! An independent sampler of wait events: `pg_stat_activity` read over and over from a
//! connection of its own, each read counting what every client backend shows at that moment,
//! as monitoring tools that poll it do. The reference pgscope's sampled off-CPU time is
//! checked against.

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};

use crate::cluster::PgCluster;

/// Every client backend but the poller's own: `wait_event_type:wait_event` (empty when it
/// waits on nothing) and `state`.
const POLL: &str = "SELECT coalesce(wait_event_type || ':' || wait_event, ''), coalesce(state, '') \
     FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";

/// What the polls saw: how many times each (state, wait event) was seen, summed over backends.
#[derive(Debug, Clone, Default)]
pub struct ActivitySamples {
    /// Reads of pg_stat_activity made.
    pub polls: u64,
    /// (state, wait event or `None`) → rows seen with it.
    pub seen: BTreeMap<(String, Option<String>), u64>,
    /// From the first read to the last.
    pub elapsed: Duration,
}

impl ActivitySamples {
    /// Reads per second achieved.
    pub fn rate_hz(&self) -> f64 {
        self.polls as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Polls pg_stat_activity at `hz` for `window` through one long-lived connection (its own
/// backend, left out of what it counts). On a busy machine a read can come late; the next ones
/// then follow at once until the schedule is caught up, so the reads stay spread evenly.
pub fn sample_activity(cluster: &PgCluster, hz: u32, window: Duration) -> Result<ActivitySamples> {
    ensure!(hz > 0, "a poll rate of 0 Hz");
    let mut connection = cluster.connect()?;
    let interval = Duration::from_secs(1) / hz;
    let mut samples = ActivitySamples::default();
    let start = Instant::now();
    while start.elapsed() < window {
        let rows = connection.query(POLL)?;
        for line in rows.lines() {
            let (wait, state) = line
                .split_once('|')
                .ok_or_else(|| anyhow::anyhow!("unexpected pg_stat_activity row `{line}`"))?;
            let wait = (!wait.is_empty()).then(|| wait.to_owned());
            *samples.seen.entry((state.to_owned(), wait)).or_insert(0) += 1;
        }
        samples.polls += 1;
        let next = start + interval * u32::try_from(samples.polls).unwrap_or(u32::MAX);
        if let Some(left) = next.checked_duration_since(Instant::now()) {
            thread::sleep(left);
        }
    }
    samples.elapsed = start.elapsed();
    connection.close()?;
    Ok(samples)
}
