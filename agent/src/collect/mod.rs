//! The collection core: one code path from the BPF ring buffer to per-instance stacks, with two
//! front ends — `trace` (one instance or backend, for a while) and `agent` (every instance on
//! the host, continuously).

pub mod blockers;
pub mod driver;
pub mod instance;
pub mod live;
pub mod off_cpu;
pub mod probes;
pub mod session;
pub mod settings_seen;
mod statement_link;
mod statement_read;
mod wait_reassembly;

use aya::maps::{MapData, RingBuf};

pub use instance::InstanceFacts;
pub use session::{InstanceStacks, Session};

/// Hands every sample waiting in the ring buffer to the session, then gives the samples still
/// waiting for their statement's queryid the one their backend shows now.
pub fn drain(ring: &mut RingBuf<MapData>, session: &mut Session) {
    while let Some(item) = ring.next() {
        session.handle(&item);
    }
    session.resolve_held_from_memory();
}
