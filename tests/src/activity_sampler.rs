//! An independent sampler of wait events: `pg_stat_activity` read over and over from a
//! connection of its own, each read counting what every client backend shows at that moment,
//! as monitoring tools that poll it do. The reference pgscope's sampled off-CPU time is
//! checked against.

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

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
///
/// The poll's chain (this thread, psql and its reader thread, the backend) runs at real-time
/// priority, as pgscope's own sampler does, so that each read takes its snapshot when its timer
/// fires. At normal priority, on 2 CPUs busy with pgbench, the backend gets its CPU only when a
/// running thread blocks or its slice ends, and its snapshots are not of random instants:
/// against the exact context-switch tracer of the same window (TPC-B, 8 clients, 100 Hz) they
/// showed `Client:ClientRead` 2.9-4.6 points above its share of the time and
/// `Lock:transactionid` 2.4-3.7 below; at real-time priority within 2 points.
/// `SCHED_FIFO` cannot hang the poll: a backend caught in the middle of updating its status
/// entry gets a CPU from the other one or from the kernel's real-time throttling.
pub fn sample_activity(cluster: &PgCluster, hz: u32, window: Duration) -> Result<ActivitySamples> {
    ensure!(hz > 0, "a poll rate of 0 Hz");
    // Before the connection: psql and the connection's reader thread inherit the policy.
    let realtime = RealtimeThread::enter()?;
    let mut connection = cluster.connect()?;
    set_realtime(connection.pid()).context("cannot run the poller's backend at real-time priority")?;
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
    drop(realtime);
    Ok(samples)
}

/// `SCHED_FIFO` at the lowest real-time priority, the one pgscope's wait sampler runs at.
const POLL_PRIORITY: libc::c_int = 1;

/// The calling thread at real-time priority until dropped; then back to its policy before.
struct RealtimeThread {
    policy: libc::c_int,
    param: libc::sched_param,
}

impl RealtimeThread {
    fn enter() -> Result<Self> {
        // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param the call fills.
        let mut param = libc::sched_param { sched_priority: 0 };
        let policy = unsafe { libc::sched_getscheduler(0) };
        if policy < 0 || unsafe { libc::sched_getparam(0, &mut param) } != 0 {
            return Err(std::io::Error::last_os_error())
                .context("cannot read the test thread's scheduling policy");
        }
        set_realtime(0)
            .context("cannot run the pg_stat_activity poller at real-time priority (needs root)")?;
        Ok(Self { policy, param })
    }
}

impl Drop for RealtimeThread {
    fn drop(&mut self) {
        // SAFETY: pid 0 is the calling thread; `param` is the valid sched_param read before.
        unsafe { libc::sched_setscheduler(0, self.policy, &self.param) };
    }
}

/// Puts `pid` (0: the calling thread) in `SCHED_FIFO` at [`POLL_PRIORITY`].
fn set_realtime(pid: u32) -> Result<()> {
    let pid = libc::pid_t::try_from(pid).context("pid out of range")?;
    let param = libc::sched_param {
        sched_priority: POLL_PRIORITY,
    };
    // SAFETY: `param` is a valid sched_param the call only reads.
    if unsafe { libc::sched_setscheduler(pid, libc::SCHED_FIFO, &param) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}
