//! The one collection loop both front ends run. It drains the ring buffer into the session as
//! records arrive, forgets exited processes every second, and advances the function probes'
//! duty cycles; what differs — when to stop, what to show or send, signals — is the front
//! end's [`Policy`].

use std::time::Duration;

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tracing::warn;

use super::{drain, Session};
use crate::bpf::OnCpuProbes;

/// How often the function probes' duty cycles advance.
pub const DUTY_TICK: Duration = Duration::from_millis(50);

/// How often the samples waiting for their statement's queryid are looked up in their backends'
/// memory between batches of samples: a client waiting a few tens of milliseconds between
/// statements leaves the last one's queryid readable that long. A no-op when none waits.
const HELD_TICK: Duration = Duration::from_millis(10);

/// A wait sample weighs the time since the last one, up to this: a loop held up for longer
/// (a stalled upload) does not make one sample stand for seconds.
const MAX_WAIT_WEIGHT: Duration = Duration::from_millis(500);

/// Whether the loop goes on after a front end's event.
pub enum Flow {
    Continue,
    Stop,
}

/// What a front end does in the loop.
pub trait Policy {
    /// A front end's own kind of event: a deadline, a signal, an upload tick.
    type Event;

    /// Waits for the next event of the front end. Dropped when the loop does something else
    /// first, so it must only wait (timers, signals), never do work.
    async fn next_event(&mut self) -> Self::Event;

    /// Handles an event; `ring` is there for a front end that must take the records already
    /// waiting first (an upload of the interval so far).
    async fn handle(
        &mut self,
        event: Self::Event,
        session: &mut Session,
        probes: &mut OnCpuProbes,
        ring: &mut RingBuf<MapData>,
    ) -> Result<Flow>;

    /// Once a second, after exited processes were forgotten.
    fn each_second(&mut self, session: &mut Session, probes: &mut OnCpuProbes);

    /// Every [`DUTY_TICK`]: the function probes' duty cycles.
    fn duty_tick(&mut self, session: &Session, probes: &mut OnCpuProbes) -> Result<()>;
}

/// Runs the loop until the policy stops it; the records still in the ring buffer then are
/// taken too. Returns the ring buffer (the front end drops it with the probes). With the wait
/// sampler attached, it runs at `frequency_hz`, the on-CPU sampling frequency, so that on- and
/// off-CPU samples weigh alike.
pub async fn run<P: Policy>(
    ring: RingBuf<MapData>,
    session: &mut Session,
    probes: &mut OnCpuProbes,
    policy: &mut P,
    frequency_hz: u64,
) -> Result<RingBuf<MapData>> {
    // SAFETY: the RingBuf owns its map fd for as long as the AsyncFd owns the RingBuf, and
    // always returns that same fd.
    let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
        .context("registering the ring buffer with tokio")?;
    let mut second = tokio::time::interval(Duration::from_secs(1));
    let mut duty = tokio::time::interval(DUTY_TICK);
    let mut held = tokio::time::interval(HELD_TICK);
    held.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sampling_waits = probes.samples_waits();
    let wait_period = Duration::from_nanos(1_000_000_000 / frequency_hz.max(1));
    let mut wait_tick = tokio::time::interval(wait_period);
    // Late ticks are not made up in a burst: the next sample weighs the time that passed.
    wait_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_wait_sample = tokio::time::Instant::now();
    loop {
        // The branches' futures are dropped before a handler runs: handlers may use what
        // they borrowed.
        tokio::select! {
            readable = ring.readable_mut() => {
                let mut guard = readable.context("waiting on the ring buffer")?;
                drain(guard.get_inner_mut(), session);
                guard.clear_ready();
            }
            _ = second.tick() => {
                session.forget_exited();
                policy.each_second(session, probes);
            }
            _ = duty.tick() => policy.duty_tick(session, probes)?,
            // A backend gone idle after its last sample sends none to trigger the read.
            _ = held.tick() => session.resolve_held_from_memory(),
            _ = wait_tick.tick(), if sampling_waits => {
                let now = tokio::time::Instant::now();
                let weight = now.saturating_duration_since(last_wait_sample).min(MAX_WAIT_WEIGHT);
                last_wait_sample = now;
                // The first tick fires at once: it has no time behind it.
                if !weight.is_zero() {
                    if let Err(error) = probes.sample_waits(weight.as_nanos() as u64) {
                        warn!("off-CPU sampling stopped: {error:#}; on-CPU profiling goes on");
                        sampling_waits = false;
                    }
                }
            }
            event = policy.next_event() => {
                if let Flow::Stop = policy.handle(event, session, probes, ring.get_mut()).await? {
                    break;
                }
            }
        }
    }
    // Records already in the ring buffer belong to the session.
    drain(ring.get_mut(), session);
    Ok(ring.into_inner())
}
