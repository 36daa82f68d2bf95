//! The upload queue: batches (one encoded push each) wait in memory, oldest first, for a
//! background task that sends them. Enqueueing never waits on the network. When the queue
//! would exceed its byte cap the oldest batches are dropped and counted; a batch that fails
//! with a retryable error stays at the head and is retried with exponential backoff and full
//! jitter, so nothing that fits in the queue is lost while Pyroscope is away.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::client::{ClientConfig, PushClient, PushError};
use super::series::{encode_push_request, SeriesProfile};

#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// Bytes of encoded pushes the queue may hold.
    pub queue_max_bytes: u64,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// At most one warning per this period for the same kind of failure.
    pub warn_every: Duration,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            queue_max_bytes: 64 << 20,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            warn_every: Duration::from_secs(60),
        }
    }
}

/// Counters, cumulative except the queue depth.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    pub pushes_ok: u64,
    /// Bytes of the push bodies Pyroscope accepted (compressed profiles and their labels).
    pub bytes_ok: u64,
    /// Series in the pushes Pyroscope accepted.
    pub series_ok: u64,
    pub pushes_failed_retryable: u64,
    pub pushes_failed_permanent: u64,
    pub retries: u64,
    pub dropped_queue_full_batches: u64,
    pub dropped_queue_full_bytes: u64,
    pub dropped_queue_full_series: u64,
    pub dropped_permanent_batches: u64,
    pub queue_depth_batches: u64,
    pub queue_depth_bytes: u64,
    pub last_success_unix: u64,
}

struct Batch {
    id: u64,
    body: Arc<Vec<u8>>,
    series: u64,
}

#[derive(Default)]
struct Counters {
    pushes_ok: AtomicU64,
    bytes_ok: AtomicU64,
    series_ok: AtomicU64,
    pushes_failed_retryable: AtomicU64,
    pushes_failed_permanent: AtomicU64,
    retries: AtomicU64,
    dropped_queue_full_batches: AtomicU64,
    dropped_queue_full_bytes: AtomicU64,
    dropped_queue_full_series: AtomicU64,
    dropped_permanent_batches: AtomicU64,
    last_success_unix: AtomicU64,
}

struct Shared {
    queue: Mutex<Queue>,
    /// A batch was queued: wakes an idle sender, never one backing off (an agent queues every
    /// interval, and each of those would otherwise be an immediate retry at a failing server).
    wake: Notify,
    /// Try again now, even while backing off: new settings, or the shutdown flush.
    retry_now: Notify,
    client: RwLock<Arc<PushClient>>,
    config: RwLock<SenderConfig>,
    counters: Counters,
}

#[derive(Default)]
struct Queue {
    batches: VecDeque<Batch>,
    bytes: u64,
    next_id: u64,
    /// The batch being sent: never evicted for room, so that a batch is either delivered or
    /// counted as dropped, not both.
    in_flight: Option<u64>,
}

pub struct Sender {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Sender {
    /// Starts the background task; needs a tokio runtime.
    pub fn start(client: ClientConfig, config: SenderConfig) -> Result<Self, PushError> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            retry_now: Notify::new(),
            client: RwLock::new(Arc::new(PushClient::new(&client)?)),
            config: RwLock::new(config),
            counters: Counters::default(),
        });
        let task = tokio::spawn(send_loop(shared.clone()));
        Ok(Self { shared, task })
    }

    /// New settings for the batches sent from now on; queued batches stay.
    pub fn reconfigure(&self, client: ClientConfig, config: SenderConfig) -> Result<(), PushError> {
        let client = Arc::new(PushClient::new(&client)?);
        if let Ok(mut slot) = self.shared.client.write() {
            *slot = client;
        }
        if let Ok(mut slot) = self.shared.config.write() {
            *slot = config;
        }
        self.shared.retry_now.notify_one();
        Ok(())
    }

    /// Queues the series as one push. Never waits: makes room by dropping the oldest batches.
    pub fn enqueue(&self, series: Vec<SeriesProfile>) {
        if series.is_empty() {
            return;
        }
        let count = series.len() as u64;
        let body = encode_push_request(&series);
        let size = body.len() as u64;
        let cap = self
            .shared
            .config
            .read()
            .map(|c| c.queue_max_bytes)
            .unwrap_or(u64::MAX);
        let counters = &self.shared.counters;
        let Ok(mut queue) = self.shared.queue.lock() else {
            return;
        };
        if size > cap {
            counters
                .dropped_queue_full_batches
                .fetch_add(1, Ordering::Relaxed);
            counters
                .dropped_queue_full_bytes
                .fetch_add(size, Ordering::Relaxed);
            counters
                .dropped_queue_full_series
                .fetch_add(count, Ordering::Relaxed);
            return;
        }
        while queue.bytes + size > cap {
            // The batch being sent is not the one dropped: it is delivered or counted, never
            // both.
            let sending = queue.in_flight.is_some() && queue.batches.front().map(|b| b.id) == queue.in_flight;
            let Some(oldest) = queue.batches.remove(usize::from(sending)) else {
                break;
            };
            queue.bytes -= oldest.body.len() as u64;
            counters
                .dropped_queue_full_batches
                .fetch_add(1, Ordering::Relaxed);
            counters
                .dropped_queue_full_bytes
                .fetch_add(oldest.body.len() as u64, Ordering::Relaxed);
            counters
                .dropped_queue_full_series
                .fetch_add(oldest.series, Ordering::Relaxed);
        }
        let id = queue.next_id;
        queue.next_id += 1;
        queue.bytes += size;
        queue.batches.push_back(Batch {
            id,
            body: Arc::new(body),
            series: count,
        });
        drop(queue);
        self.shared.wake.notify_one();
    }

    pub fn stats(&self) -> SenderStats {
        let c = &self.shared.counters;
        let (depth, bytes) = self
            .shared
            .queue
            .lock()
            .map(|q| (q.batches.len() as u64, q.bytes))
            .unwrap_or_default();
        SenderStats {
            pushes_ok: c.pushes_ok.load(Ordering::Relaxed),
            bytes_ok: c.bytes_ok.load(Ordering::Relaxed),
            series_ok: c.series_ok.load(Ordering::Relaxed),
            pushes_failed_retryable: c.pushes_failed_retryable.load(Ordering::Relaxed),
            pushes_failed_permanent: c.pushes_failed_permanent.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            dropped_queue_full_batches: c.dropped_queue_full_batches.load(Ordering::Relaxed),
            dropped_queue_full_bytes: c.dropped_queue_full_bytes.load(Ordering::Relaxed),
            dropped_queue_full_series: c.dropped_queue_full_series.load(Ordering::Relaxed),
            dropped_permanent_batches: c.dropped_permanent_batches.load(Ordering::Relaxed),
            queue_depth_batches: depth,
            queue_depth_bytes: bytes,
            last_success_unix: c.last_success_unix.load(Ordering::Relaxed),
        }
    }

    /// Waits until the queue is empty or `deadline` passes, then stops the task. Returns the
    /// batches left unsent.
    pub async fn flush(self, deadline: Duration) -> u64 {
        self.shared.retry_now.notify_one();
        let shared = self.shared.clone();
        let drained = async move {
            loop {
                let empty = shared.queue.lock().map(|q| q.batches.is_empty()).unwrap_or(true);
                if empty {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let _ = tokio::time::timeout(deadline, drained).await;
        self.task.abort();
        self.stats().queue_depth_batches
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends the head batch until the queue is empty, then sleeps until woken.
async fn send_loop(shared: Arc<Shared>) {
    let mut backoff: Option<Duration> = None;
    let mut warnings = Warnings::default();
    loop {
        let head = shared.queue.lock().ok().and_then(|mut q| {
            let head = q.batches.front().map(|b| (b.id, b.body.clone(), b.series));
            q.in_flight = head.as_ref().map(|(id, _, _)| *id);
            head
        });
        let Some((id, body, series)) = head else {
            tokio::select! {
                _ = shared.wake.notified() => {}
                _ = shared.retry_now.notified() => {}
            }
            continue;
        };
        let client = match shared.client.read() {
            Ok(client) => client.clone(),
            Err(_) => return,
        };
        let config = shared.config.read().map(|c| c.clone()).unwrap_or_default();
        let counters = &shared.counters;
        match client.push(body.as_ref().clone()).await {
            Ok(()) => {
                counters.pushes_ok.fetch_add(1, Ordering::Relaxed);
                counters.bytes_ok.fetch_add(body.len() as u64, Ordering::Relaxed);
                counters.series_ok.fetch_add(series, Ordering::Relaxed);
                counters.last_success_unix.store(unix_now(), Ordering::Relaxed);
                remove_if_head(&shared, id);
                if backoff.take().is_some() {
                    info!("Pyroscope takes profiles again; sending what was queued");
                }
                warnings.reset();
            }
            Err(error) if error.is_retryable() => {
                // Not in flight while waiting: a full queue may drop it like any oldest batch.
                if let Ok(mut queue) = shared.queue.lock() {
                    queue.in_flight = None;
                }
                counters.pushes_failed_retryable.fetch_add(1, Ordering::Relaxed);
                counters.retries.fetch_add(1, Ordering::Relaxed);
                let next = match backoff {
                    None => config.initial_backoff,
                    Some(previous) => (previous * 2).min(config.max_backoff),
                };
                backoff = Some(next);
                warnings.warn(&config, "retryable", || {
                    format!("{error}; profiles stay queued and are sent when it answers (retrying)")
                });
                // Full jitter: agents that lost the server together do not come back together.
                let wait = next.mul_f64(fastrand::f64());
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    // A reload (new URL or credentials) or the shutdown flush retries at once.
                    _ = shared.retry_now.notified() => {}
                }
            }
            Err(error) => {
                counters.pushes_failed_permanent.fetch_add(1, Ordering::Relaxed);
                counters.dropped_permanent_batches.fetch_add(1, Ordering::Relaxed);
                remove_if_head(&shared, id);
                warnings.warn(&config, "permanent", || {
                    format!("{error}; the batch is dropped (sending it again would fail the same way)")
                });
            }
        }
    }
}

/// Removes the batch just sent, unless it was dropped for room meanwhile.
fn remove_if_head(shared: &Shared, id: u64) {
    if let Ok(mut queue) = shared.queue.lock() {
        queue.in_flight = None;
        if queue.batches.front().is_some_and(|b| b.id == id) {
            if let Some(batch) = queue.batches.pop_front() {
                queue.bytes -= batch.body.len() as u64;
            }
        }
    }
}

/// One warning per kind per period, with how many were held back.
#[derive(Default)]
struct Warnings {
    last: Option<(&'static str, Instant)>,
    suppressed: u64,
}

impl Warnings {
    fn warn(&mut self, config: &SenderConfig, kind: &'static str, message: impl FnOnce() -> String) {
        let due = match self.last {
            Some((last_kind, at)) => last_kind != kind || at.elapsed() >= config.warn_every,
            None => true,
        };
        if due {
            if self.suppressed > 0 {
                warn!(
                    "{} (and {} more failures since the last warning)",
                    message(),
                    self.suppressed
                );
            } else {
                warn!("{}", message());
            }
            self.last = Some((kind, Instant::now()));
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
    }

    fn reset(&mut self) {
        self.last = None;
        self.suppressed = 0;
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
