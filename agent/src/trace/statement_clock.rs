//! Counts the statements an instance's backends run, to scale duty-cycled probe counts. A probe
//! attached only part of the time sees the workload while it slows it: scaling its calls by
//! time would extrapolate the slower rate (measured here: ~30% low for LockRelationOid). Scaled
//! by statements instead — calls while attached × all statements / statements while attached —
//! the estimate is right whenever calls per statement do not depend on whether the probe is
//! attached, which is what a probe measures.
//!
//! The count is each backend's `st_changecount` (its PgBackendStatus entry in shared memory),
//! which every status write bumps: at least one write at each statement's start and end. It is
//! read from outside (one `pread` per backend, on every tick of the duty cycle and at every
//! switch), so it costs nothing per statement.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::postgres::memory::read_u64;

/// Where a backend's status counter is: `MyBEEntry`'s address (the same in every process forked
/// from one postmaster) and the counter's offset in `PgBackendStatus`.
#[derive(Clone, Copy, Debug)]
pub struct CounterLayout {
    pub my_be_entry: u64,
    pub st_changecount_offset: u32,
}

/// Statement progress of a set of backends between reads.
#[derive(Debug)]
pub struct StatementClock {
    layout: CounterLayout,
    /// Per process: its memory, the counter's address once `MyBEEntry` is set, and the
    /// counter's last value.
    backends: HashMap<u32, Backend>,
}

#[derive(Debug)]
struct Backend {
    mem: File,
    counter: u64,
    last: u32,
}

impl Backend {
    /// Opens process `pid` and finds its counter; None while it has no status entry.
    fn open(pid: u32, layout: CounterLayout) -> Option<(Backend, u32)> {
        let mem = File::open(format!("/proc/{pid}/mem")).ok()?;
        let entry = read_u64(pid, layout.my_be_entry).ok()?;
        if entry == 0 {
            return None;
        }
        let mut backend = Backend {
            mem,
            counter: entry + u64::from(layout.st_changecount_offset),
            last: 0,
        };
        let value = backend.read()?;
        Some((backend, value))
    }

    fn read(&mut self) -> Option<u32> {
        let mut bytes = [0u8; 4];
        self.mem.read_exact_at(&mut bytes, self.counter).ok()?;
        Some(u32::from_ne_bytes(bytes))
    }
}

impl StatementClock {
    pub fn new(layout: CounterLayout) -> Self {
        Self {
            layout,
            backends: HashMap::new(),
        }
    }

    /// Status writes of `pids` since the previous call. A process seen for the first time only
    /// sets its starting point; processes without a status entry (the postmaster, a backend
    /// still starting) and processes gone are skipped and forgotten.
    pub fn advance(&mut self, pids: &[u32]) -> u64 {
        let mut progress = 0u64;
        let mut now = HashMap::with_capacity(pids.len());
        for &pid in pids {
            let backend = match self.backends.remove(&pid) {
                Some(mut backend) => match backend.read() {
                    Some(value) => {
                        // A C int that wraps; the difference modulo 2^32 is the progress.
                        progress += u64::from(value.wrapping_sub(backend.last));
                        backend.last = value;
                        backend
                    }
                    None => continue,
                },
                None => match Backend::open(pid, self.layout) {
                    Some((mut backend, value)) => {
                        backend.last = value;
                        backend
                    }
                    None => continue,
                },
            };
            now.insert(pid, backend);
        }
        self.backends = now;
        progress
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process stands in for a backend: a pointer global to a status "entry" whose first
    /// field is the counter.
    #[test]
    fn counts_progress_since_the_last_read_and_baselines_new_processes() {
        let mut entry = Box::new([7u32, 0]);
        let pointer = Box::new(entry.as_mut_ptr() as u64);
        let layout = CounterLayout {
            my_be_entry: &*pointer as *const u64 as u64,
            st_changecount_offset: 0,
        };
        let pid = std::process::id();
        let mut clock = StatementClock::new(layout);
        assert_eq!(clock.advance(&[pid]), 0, "the first read is a starting point");
        // SAFETY: `entry` is alive and only this thread touches it; volatile because the
        // clock reads it through /proc/self/mem, behind the compiler's back.
        unsafe { std::ptr::write_volatile(entry.as_mut_ptr(), 11) };
        assert_eq!(clock.advance(&[pid, u32::MAX - 2]), 4);
        unsafe { std::ptr::write_volatile(entry.as_mut_ptr(), u32::MAX - 1) };
        clock.advance(&[pid]);
        unsafe { std::ptr::write_volatile(entry.as_mut_ptr(), 1) };
        assert_eq!(clock.advance(&[pid]), 3, "wraps like a C int");
    }

    #[test]
    fn a_process_without_a_status_entry_is_skipped() {
        let pointer = Box::new(0u64);
        let mut clock = StatementClock::new(CounterLayout {
            my_be_entry: &*pointer as *const u64 as u64,
            st_changecount_offset: 0,
        });
        assert_eq!(clock.advance(&[std::process::id()]), 0);
        assert_eq!(clock.advance(&[std::process::id()]), 0);
    }
}
