//! Who blocks whom, polled while samples are taken: [`crate::postgres::blockers`] on a
//! connection of the poller's own, every [`TRACE_INTERVAL`] in a trace and [`AGENT_INTERVAL`]
//! in the agent, in a task beside the collection. A
//! trace polls for its length and stops at the first failure (said in one line); the agent
//! polls each instance for as long as it runs, reconnecting a minute after a failure, and
//! takes what the polls found at each upload. An instance that cannot be reached, or a role
//! that may not call `pg_blocking_pids()`, costs the findings about blockers and nothing else.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::postgres::blockers::{self, BlockerEvidence, BlockerLog};
use crate::postgres::sql;
use crate::redact;

/// Between a trace's polls: a lock wait shorter than this is seen by chance, one that matters
/// (seconds behind a session idle in its transaction) by several polls.
pub const TRACE_INTERVAL: Duration = Duration::from_millis(500);
/// Between the agent's polls of each instance: it polls for as long as it runs, over every
/// instance of the host, and each poll reads pg_stat_activity (every backend's status entry).
pub const AGENT_INTERVAL: Duration = Duration::from_secs(1);

/// A poll may take this long before the poller gives up on the connection: a poll that waits
/// longer is itself held up, and the next would be too.
const POLL_TIMEOUT: Duration = Duration::from_secs(5);

/// What the polls found so far, and why they stopped if they did.
#[derive(Debug)]
struct Shared {
    log: BlockerLog,
    stopped: Option<String>,
}

/// A running poller; dropping it stops the polls.
#[derive(Debug)]
pub struct BlockerPoller {
    shared: Arc<Mutex<Shared>>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl BlockerPoller {
    /// Connects to `target` and polls every `interval` until stopped. With `retry`, a failed
    /// connection or poll is tried again that much later; without, polling stops at the first
    /// failure.
    pub fn start(target: Result<sql::Connect>, interval: Duration, retry: Option<Duration>) -> Self {
        let shared = Arc::new(Mutex::new(Shared {
            log: BlockerLog::new(interval.as_secs_f64()),
            stopped: None,
        }));
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(poll_until_stopped(target, retry, Arc::clone(&shared), stopped));
        Self {
            shared,
            stop,
            task: Some(task),
        }
    }

    /// What the polls found since the last take (None when no poll was made since), and
    /// starts anew.
    pub fn take(&self) -> Option<BlockerEvidence> {
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let fresh = BlockerLog::new(shared.log.interval_seconds);
        let log = std::mem::replace(&mut shared.log, fresh);
        (log.polls > 0).then(|| log.evidence())
    }

    /// Stops polling: what the polls found (None when none was made), and why they stopped
    /// early if they did.
    pub async fn finish(mut self) -> (Option<BlockerEvidence>, Option<String>) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let stopped = self
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stopped
            .take();
        (self.take(), stopped)
    }
}

impl Drop for BlockerPoller {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn poll_until_stopped(
    target: Result<sql::Connect>,
    retry: Option<Duration>,
    shared: Arc<Mutex<Shared>>,
    mut stopped: watch::Receiver<bool>,
) {
    let target = match target {
        Ok(target) => target,
        Err(error) => {
            let why = redact::error(&error);
            tracing::debug!("blocking sessions not polled: {why}");
            shared.lock().unwrap_or_else(PoisonError::into_inner).stopped = Some(why);
            return;
        }
    };
    loop {
        let why = poll_connection(&target, &shared, &mut stopped).await;
        let Some(why) = why else {
            return;
        };
        let Some(retry) = retry else {
            shared.lock().unwrap_or_else(PoisonError::into_inner).stopped = Some(why);
            return;
        };
        tracing::debug!("blocking sessions not polled ({why}): tried again in {retry:?}");
        tokio::select! {
            _ = stopped.changed() => return,
            _ = tokio::time::sleep(retry) => {}
        }
    }
}

/// Polls over one connection until stopped (None) or until it fails (why).
async fn poll_connection(
    target: &sql::Connect,
    shared: &Mutex<Shared>,
    stopped: &mut watch::Receiver<bool>,
) -> Option<String> {
    // Polled every second or faster: its statement stays out of pg_stat_statements and the
    // findings.
    let client = match sql::connect_untracked(target).await {
        Ok(client) => client,
        Err(error) => return Some(redact::error(&error)),
    };
    let interval = shared
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .log
        .interval_seconds;
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(interval));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A poll late on a busy machine counts the time it covers, not an interval.
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = stopped.changed() => return None,
            _ = ticks.tick() => {}
        }
        match tokio::time::timeout(POLL_TIMEOUT, blockers::poll(&client)).await {
            Ok(Ok(pairs)) => {
                let now = Instant::now();
                let elapsed = now.duration_since(last).as_secs_f64();
                last = now;
                shared
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .log
                    .record(&pairs, elapsed);
            }
            Ok(Err(error)) => return Some(redact::error(&error)),
            Err(_) => return Some(format!("a poll took over {POLL_TIMEOUT:?}")),
        }
    }
}
