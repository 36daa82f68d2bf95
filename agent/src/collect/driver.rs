//! The one collection loop both front ends run. It drains the ring buffer into the session as
//! records arrive, forgets exited processes every second, and advances the function probes'
//! duty cycles; what differs — when to stop, what to show or send, signals — is the front
//! end's [`Policy`].

use std::time::Duration;

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::{drain, Session};
use crate::bpf::OnCpuProbes;

/// How often the function probes' duty cycles advance.
pub const DUTY_TICK: Duration = Duration::from_millis(50);

/// How often the samples waiting for their statement's queryid are looked up in their backends'
/// memory between batches of samples: a client waiting a few tens of milliseconds between
/// statements leaves the last one's queryid readable that long. Not armed while none waits.
const HELD_TICK: Duration = Duration::from_millis(10);

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
/// taken too. Returns the ring buffer (the front end drops it with the probes). The wait
/// sampler, when attached, runs on its own thread for as long as the loop does, at
/// `frequency_hz`; the time it could not stand for is kept in the session.
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
    let sampling = probes.start_wait_sampling(frequency_hz)?;
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
                if let Some(sampling) = &sampling {
                    session.wait_sampler = sampling.tally();
                }
                session.forget_exited();
                policy.each_second(session, probes);
            }
            _ = duty.tick() => policy.duty_tick(session, probes)?,
            // A backend gone idle after its last sample sends none to trigger the read. Off
            // while no sample waits: 100 wakeups a second of an agent with nothing to do.
            _ = held.tick(), if session.holds_samples() => session.resolve_held_from_memory(),
            event = policy.next_event() => {
                if let Flow::Stop = policy.handle(event, session, probes, ring.get_mut()).await? {
                    break;
                }
            }
        }
    }
    // Stopped first: its last run's records are in the ring buffer for the drain.
    if let Some(sampling) = sampling {
        session.wait_sampler = sampling.tally();
    }
    // Records already in the ring buffer belong to the session.
    drain(ring.get_mut(), session);
    Ok(ring.into_inner())
}
