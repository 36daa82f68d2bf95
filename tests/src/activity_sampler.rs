//! An independent sampler of wait events: `pg_stat_activity` read over and over from a
//! connection of its own, each read counting what every client backend shows at that moment,
//! as monitoring tools that poll it do. The reference pgscope's sampled off-CPU time is
//! checked against.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use crate::cluster::PgCluster;

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

/// Polls pg_stat_activity at `hz` for `window`, from inside one backend of its own (left out of
/// what it counts): a PL/pgSQL loop that reads every client backend's state and wait event in a
/// transaction of its own (a statistics snapshot lasts its transaction), keeps them in a
/// variable until the window ends, and sleeps until its next instant. On a
/// busy machine a read can come late; the next ones then follow at once until the schedule is
/// caught up, so the reads stay spread evenly.
///
/// Why in the server, at real-time priority: a read is of the instant the poller takes its
/// snapshot, and each thread that must run before that instant runs on a CPU a backend had, and
/// holds that backend where it was: a backend held while running is held out of the wait it was
/// about to enter, most often `Client:ClientRead` (five times per TPC-B transaction). Read
/// through psql from the test's thread (three threads woken in turn, each at real-time
/// priority), the polls' share of `Client:ClientRead` was 3.5-6.4 points below the sampled
/// profile's on an idle machine (TPC-B, 8 clients, 100 Hz; the profile within 0.4% of the exact
/// context-switch tracer at its own instants) and 2-2.8 above on a busy one: the reference moved
/// with the load and failed the test one run in three. Read by the backend alone, woken from its
/// sleep by its timer, the difference was -2.8 to +1.6 points idle and -1.1 to +0.2 beside two
/// CPU hogs. At normal priority the backend got its CPU only when a running thread blocked or
/// its slice ended, and its reads were not of random instants at all.
/// `SCHED_FIFO` cannot hang the poll: a backend caught in the middle of updating its status
/// entry gets a CPU from the other one or from the kernel's real-time throttling.
pub fn sample_activity(cluster: &PgCluster, hz: u32, window: Duration) -> Result<ActivitySamples> {
    ensure!(hz > 0, "a poll rate of 0 Hz");
    let mut connection = cluster.connect()?;
    set_realtime(connection.pid()).context("cannot run the poller's backend at real-time priority")?;
    let interval_us = 1_000_000 / u64::from(hz);
    let started = Instant::now();
    // No write, and a commit after each read: a transaction of the poller held open for the
    // window would hold back the pruning of TPC-B's updated rows (their HOT chains would grow
    // for seconds) and change the workload it is to observe.
    connection.query(&format!(
        "DO $$\n\
         DECLARE\n\
           began timestamptz := clock_timestamp();\n\
           poll bigint := 0;\n\
           seen text[] := '{{}}';\n\
         BEGIN\n\
           WHILE clock_timestamp() < began + interval '{window_us} microseconds' LOOP\n\
             seen := seen || ARRAY({POLL});\n\
             COMMIT;\n\
             poll := poll + 1;\n\
             PERFORM pg_sleep(greatest(0, extract(epoch FROM \
                began + poll * interval '{interval_us} microseconds' - clock_timestamp())));\n\
           END LOOP;\n\
           PERFORM set_config('pgscope.polls', poll::text, false);\n\
           PERFORM set_config('pgscope.seen', array_to_string(seen, E'\\n'), false);\n\
         END $$",
        window_us = window.as_micros(),
    ))?;
    let elapsed = started.elapsed();
    let polls: u64 = connection
        .query("SELECT current_setting('pgscope.polls')")?
        .trim()
        .parse()
        .context("the poll loop counted no reads")?;
    let rows = connection.query(
        "SELECT seen, count(*) FROM unnest(string_to_array(current_setting('pgscope.seen'), E'\\n')) \
         AS seen GROUP BY 1",
    )?;
    connection.close()?;
    let mut samples = ActivitySamples {
        polls,
        elapsed,
        ..ActivitySamples::default()
    };
    for line in rows.lines() {
        let mut fields = line.split('|');
        let (Some(state), Some(wait), Some(count), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            anyhow::bail!("unexpected row of the polls `{line}`");
        };
        let count: u64 = count.parse().with_context(|| format!("bad count in `{line}`"))?;
        let wait = (!wait.is_empty()).then(|| wait.to_owned());
        *samples.seen.entry((state.to_owned(), wait)).or_insert(0) += count;
    }
    Ok(samples)
}

/// One read: every client backend but the poller's own, as `state|wait_event_type:wait_event`
/// (nothing after the bar when it waits on nothing). A statistics snapshot lasts its
/// transaction; each read is in a transaction of its own.
const POLL: &str = "SELECT coalesce(state, '') || '|' || coalesce(wait_event_type || ':' || wait_event, '') \
     FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";

/// `SCHED_FIFO` at the lowest real-time priority, the one pgscope's wait sampler runs at.
const POLL_PRIORITY: libc::c_int = 1;

/// Puts `pid` in `SCHED_FIFO` at [`POLL_PRIORITY`].
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
