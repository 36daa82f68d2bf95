//! Who blocks whom while a trace runs: [`crate::postgres::blockers`] polled on a connection of
//! its own, every [`INTERVAL`], from the moment sampling starts to its end. Best effort: an
//! instance that cannot be reached, or a role that may not call `pg_blocking_pids()`, costs
//! the findings about blockers, said in one line, and nothing else.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::sql_facts::{connect_target, shown};
use super::TraceOptions;
use crate::postgres::blockers::{self, BlockerLog};
use crate::postgres::sql;

/// Between polls: a lock wait shorter than this is seen by chance, one that matters (seconds
/// behind a session idle in its transaction) by several polls.
pub const INTERVAL: Duration = Duration::from_millis(500);

/// A poll may take this long before the poller gives up on the instance: a poll that waits
/// longer is itself held up, and the next would be too.
const POLL_TIMEOUT: Duration = Duration::from_secs(5);

/// The running poller.
pub struct BlockerPoller {
    stop: watch::Sender<bool>,
    task: JoinHandle<(BlockerLog, Option<String>)>,
}

impl BlockerPoller {
    /// Connects and polls until [`BlockerPoller::finish`].
    pub fn start(options: &TraceOptions, pid: u32) -> Self {
        let target = connect_target(options, pid);
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut log = BlockerLog::new(INTERVAL.as_secs_f64());
            let client = match target {
                Ok(target) => sql::connect(&target).await,
                Err(error) => Err(error),
            };
            let client = match client {
                Ok(client) => client,
                Err(error) => return (log, Some(shown(&error))),
            };
            let mut ticks = tokio::time::interval(INTERVAL);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // A poll late on a busy machine counts the time it covers, not an interval.
            let mut last = Instant::now();
            loop {
                tokio::select! {
                    _ = stopped.changed() => return (log, None),
                    _ = ticks.tick() => {}
                }
                match tokio::time::timeout(POLL_TIMEOUT, blockers::poll(&client)).await {
                    Ok(Ok(pairs)) => {
                        let now = Instant::now();
                        log.record(&pairs, now.duration_since(last).as_secs_f64());
                        last = now;
                    }
                    Ok(Err(error)) => return (log, Some(shown(&error))),
                    Err(_) => {
                        return (
                            log,
                            Some(format!("a poll took over {POLL_TIMEOUT:?}; polling stopped")),
                        )
                    }
                }
            }
        });
        Self { stop, task }
    }

    /// Stops polling: what the polls found, and why they stopped early if they did.
    pub async fn finish(self) -> (BlockerLog, Option<String>) {
        let _ = self.stop.send(true);
        match self.task.await {
            Ok(result) => result,
            Err(error) => (
                BlockerLog::new(INTERVAL.as_secs_f64()),
                Some(format!("the poller ended abnormally: {error}")),
            ),
        }
    }
}
