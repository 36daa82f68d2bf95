//! The wait sampler's clock: a thread of its own runs the sampler's two passes at the profiling
//! frequency, the first and then, when that left it threads, the second (their stacks, copied
//! after every thread's wait is decided): the kfunc programs over the profiled processes'
//! threads (`wait_targets`), or the task iterators over every thread of the host
//! ([`Passes`]). Not the collection loop: a loop busy
//! draining the ring buffer would delay the ticks, and run them at its quiet moments, which
//! would bias what they see. Each run weighs the time since the last one (set in
//! `wait_sample_config` before it); time a tick could not stand for (a thread held up for more
//! than [`MAX_WEIGHT`]) is counted, not lost silently.
//!
//! The thread runs at the lowest real-time priority, so that a tick runs when its timer
//! fires. At normal priority, on busy CPUs, it waits its turn behind the threads that just
//! woke, 0.2-0.3 ms on average here: long enough for a convoy of short lock waits to end
//! before the tick sees it. Measured on the pg_stat_statements eviction storm (16 clients on
//! two CPUs), the sampled off-CPU total was then 0.62-0.69 of the exact tracer's, and
//! `LWLock:pg_stat_statements` less than half of it; at real-time priority, with the run's own
//! doing left out (`left_cpu_since_instant` in the BPF program), 0.97-1.43, median 1.11, over
//! 26 runs of 20-60 s (1.01-1.36, median 1.19, over 16 runs of 20 s on a later day). A run
//! is bounded (its stack budget), and the kernel's real-time throttling bounds it again.
//!
//! What a run costs is counted ([`WaitSamplerTally`]): each run takes its CPU from the backend
//! there, and one holding a lock makes the others wait that much longer. The exact tracer
//! counts that wait; the run's samples, taken at its start, cannot. On the eviction storm a run
//! of 1 ms more (a spin added after each) took the lock's sampled time from 1.03 to 0.94 of
//! the exact tracer's, and the (no wait event) row from 0.76 to 0.59.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use aya::maps::{Array, MapData};
use tracing::warn;

use super::iter::IterLink;
use super::wait_targets::TargetPasses;

/// A sample weighs the time since the last run, up to this: a thread held up for longer does
/// not make one sample stand for seconds.
const MAX_WEIGHT: Duration = Duration::from_millis(500);

/// `wait_sample_config` index of the threads the first pass left to the second.
const PENDING_INDEX: u32 = 4;

/// `wait_sample_config` index of the sampler thread's id, set under `--off-cpu=both`: the exact
/// tracer then tells the waits a run causes (it takes the CPU from the backend there), and each
/// run adds where the tracer has every thread, as it reaches it, to `exact_at_runs`.
const SAMPLER_TID_INDEX: u32 = 6;

/// `SCHED_FIFO` priority of the sampler's thread: the lowest, above every normal thread and
/// below every other real-time one.
const REALTIME_PRIORITY: i32 = 1;

/// How a run's two passes reach the threads they sample. The first decides which thread waits
/// where, as at the run's instant; the second copies the stacks of the threads the first left
/// to it.
pub(super) enum Passes {
    /// A syscall program visiting the targets' threads alone, both passes in one run
    /// (`bpf/wait_targets.bpf.c`).
    Targets(TargetPasses),
    /// Task iterators visiting every thread of the host (`sample_waits`, `sample_wait_stacks`).
    Iterators { first: IterLink, second: IterLink },
}

/// The loaded sampler, not running yet.
pub struct WaitSampler {
    pub(super) passes: Passes,
    /// Index 0: the weight of the next run's samples (ns); index 4, after the first pass: how
    /// many threads it left to the second.
    pub(super) config: Array<MapData, u64>,
    /// The exact tracer runs too: the runs measure its state at their instants.
    pub(super) exact_beside: bool,
}

/// The sampler running at its frequency; dropping it stops the thread (after its current run).
pub struct WaitSampling {
    stop: Arc<AtomicBool>,
    tally: Arc<SharedTally>,
    thread: Option<JoinHandle<()>>,
}

/// What the sampler's thread did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitSamplerTally {
    /// Runs (ticks) done.
    pub runs: u64,
    /// Their time, in ns, from the first pass's start to the second's end: time the backend
    /// on the sampler's CPU could not run.
    pub run_ns: u64,
    /// Off-CPU time no sample stood for: the thread was held up longer than [`MAX_WEIGHT`]
    /// between two runs.
    pub unsampled_ns: u64,
}

impl WaitSamplerTally {
    /// A run's mean time, in microseconds.
    pub fn mean_run_us(&self) -> f64 {
        match self.runs {
            0 => 0.0,
            runs => self.run_ns as f64 / runs as f64 / 1e3,
        }
    }

    /// The runs' share of one CPU over `elapsed_ns`, in percent.
    pub fn cpu_pct(&self, elapsed_ns: u64) -> f64 {
        match elapsed_ns {
            0 => 0.0,
            elapsed => 100.0 * self.run_ns as f64 / elapsed as f64,
        }
    }
}

#[derive(Default)]
struct SharedTally {
    runs: AtomicU64,
    run_ns: AtomicU64,
    unsampled_ns: AtomicU64,
}

impl WaitSampler {
    /// Starts sampling every `1 / frequency_hz`.
    pub fn start(self, frequency_hz: u64) -> Result<WaitSampling> {
        let period = Duration::from_nanos(1_000_000_000 / frequency_hz.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(SharedTally::default());
        let thread = std::thread::Builder::new()
            .name("pgscope-waits".into())
            .spawn({
                let stop = stop.clone();
                let tally = tally.clone();
                move || self.run(period, &stop, &tally)
            })
            .context("starting the wait sampler's thread")?;
        Ok(WaitSampling {
            stop,
            tally,
            thread: Some(thread),
        })
    }

    fn run(mut self, period: Duration, stop: &AtomicBool, tally: &SharedTally) {
        if let Err(error) = run_at_realtime_priority() {
            warn!(
                "the off-CPU sampler runs at normal priority ({error}): its ticks wait behind \
                 the threads they sample, and short waits (lock convoys) are undercounted; \
                 give pgscope CAP_SYS_NICE, or use --off-cpu=exact"
            );
        }
        if self.exact_beside {
            // SAFETY: gettid has no arguments and cannot fail.
            let tid = unsafe { libc::gettid() };
            if let Err(error) = self.config.set(SAMPLER_TID_INDEX, tid as u64, 0) {
                warn!("the exact off-CPU state at the sampler's instants is not measured: {error}");
            }
        }
        let mut last = Instant::now();
        let mut next = last + period;
        while !stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            // The next deadline follows the schedule, not this tick's lateness; a tick later
            // than a whole period starts the schedule again rather than running a burst.
            next += period;
            let now = Instant::now();
            if next <= now {
                next = now + period;
            }
            let elapsed = now.duration_since(last);
            last = now;
            let weight = elapsed.min(MAX_WEIGHT);
            tally
                .unsampled_ns
                .fetch_add((elapsed - weight).as_nanos() as u64, Ordering::Relaxed);
            let result = self.tick(weight);
            tally.runs.fetch_add(1, Ordering::Relaxed);
            tally
                .run_ns
                .fetch_add(now.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Err(error) = result {
                warn!("off-CPU sampling stopped: {error:#}; on-CPU profiling goes on");
                break;
            }
        }
        self.flush();
    }

    /// Adds the idle ticks the kfunc passes deferred in threads' storage to their totals; the
    /// task iterators defer none.
    fn flush(&self) {
        if let Passes::Targets(passes) = &self.passes {
            if let Err(error) = passes.flush() {
                warn!("the last idle off-CPU ticks (at most 32 per thread) are not counted: {error:#}");
            }
        }
    }

    /// One run: the first pass, and the second when the first left it threads. The kfunc
    /// passes are one program, the weight in its context (a syscall a tick rather than up to
    /// four: 13 us for the map update, 5 for the map read, about 12 for a second program, of
    /// a 99 us run here); the iterators use the config map.
    fn tick(&mut self, weight: Duration) -> Result<()> {
        let (first, second) = match &self.passes {
            Passes::Targets(passes) => return passes.run(weight),
            Passes::Iterators { first, second } => (first, second),
        };
        self.config
            .set(0, weight.as_nanos() as u64, 0)
            .context("setting the wait samples' weight")?;
        first.run().context("running the wait sampler's task iterator")?;
        let pending = self
            .config
            .get(&PENDING_INDEX, 0)
            .context("reading how many stacks the wait sampler's first pass left")?;
        if pending > 0 {
            second
                .run()
                .context("running the wait sampler's stack iterator")?;
        }
        Ok(())
    }
}

/// Puts the calling thread in `SCHED_FIFO` at [`REALTIME_PRIORITY`]; threads it would start
/// are not (`SCHED_RESET_ON_FORK`).
fn run_at_realtime_priority() -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: REALTIME_PRIORITY,
    };
    // SAFETY: `param` is a valid sched_param the call only reads; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl WaitSampling {
    /// What the sampler's thread did so far.
    pub fn tally(&self) -> WaitSamplerTally {
        WaitSamplerTally {
            runs: self.tally.runs.load(Ordering::Relaxed),
            run_ns: self.tally.run_ns.load(Ordering::Relaxed),
            unsampled_ns: self.tally.unsampled_ns.load(Ordering::Relaxed),
        }
    }
}

impl Drop for WaitSampling {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
