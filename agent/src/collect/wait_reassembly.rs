//! Off-CPU waits put back together from their records. A wait whose stacks were sent as it began
//! is held here until its end record brings its blocked time; a wait open for a second or more
//! is shipped in parts while it lasts (the agent does at every upload), and its end then counts
//! only what was not shipped. The session places what comes out with its instance.

use std::collections::HashMap;

use crate::bpf::abi::{LongWaitEnd, OffCpuClass, WaitEnd, OFF_CPU_LONG_NS};
use crate::bpf::OpenWait;
use crate::postgres::attribution::Attribution;
use symbolizer::UnwoundStack;

/// A wait whose stacks were taken when it began; its blocked time is still to come.
#[derive(Clone)]
pub struct PendingWait {
    pub root: u32,
    pub tgid: u32,
    pub start_ns: u64,
    pub attribution: Attribution,
    pub class: OffCpuClass,
    pub syscall: &'static str,
    pub user: UnwoundStack,
}

/// A part of a wait still open, to be counted now.
pub enum OpenPart {
    /// With the stacks its wait began with.
    WithStacks(PendingWait, u64),
    /// Without stacks: labelled like any sample of its process.
    WithoutStacks(OpenWait, u64),
}

#[derive(Default)]
pub struct WaitReassembly {
    /// Waits in progress whose stacks came when they began, by thread.
    pending: HashMap<u32, PendingWait>,
    /// Wait ends without their stacks (the record was lost or did not match).
    pub unmatched_ends: u64,
    /// Long waits still open of which parts were shipped, by thread and start: the
    /// nanoseconds shipped, which their end leaves out.
    shipped_open: HashMap<(u32, u64), u64>,
}

impl WaitReassembly {
    /// Holds the stacks of a wait that began on thread `tid`.
    pub fn begin(&mut self, tid: u32, wait: PendingWait) {
        self.pending.insert(tid, wait);
    }

    /// The wait `end` closes with the time of it not shipped yet; None when its stacks never
    /// came (counted) or all of it was shipped.
    pub fn end(&mut self, end: &WaitEnd) -> Option<(PendingWait, u64)> {
        let Some(pending) = self.pending.remove(&end.tid) else {
            self.unmatched_ends += 1;
            return None;
        };
        if pending.start_ns != end.start_ns {
            self.unmatched_ends += 1;
            return None;
        }
        let rest = self.not_shipped(end.tid, end.start_ns, end.blocked_ns);
        (rest > 0).then_some((pending, rest))
    }

    /// The time of a long wait without stacks that was not shipped while it was open.
    pub fn end_long(&mut self, end: &LongWaitEnd) -> u64 {
        self.not_shipped(end.tid, end.start_ns, end.blocked_ns)
    }

    fn not_shipped(&mut self, tid: u32, start_ns: u64, blocked_ns: u64) -> u64 {
        let shipped = self.shipped_open.remove(&(tid, start_ns)).unwrap_or(0);
        blocked_ns.saturating_sub(shipped)
    }

    /// What grew, since it was last shipped, of every wait open for a second or more. A part
    /// goes where the wait's end will: with its stacks when they were taken as it began, else
    /// with the frame of its kind of wait.
    pub fn open_parts(&mut self, open: &[OpenWait]) -> Vec<OpenPart> {
        // A wait that ended is forgotten with its end record; one whose end record never came
        // (its process gone) is forgotten here.
        self.shipped_open.retain(|(tid, start), _| {
            open.iter().any(|w| w.tid == *tid && w.start_ns == *start) || crate::liveness::exists(*tid)
        });
        let mut parts = Vec::new();
        for wait in open.iter().filter(|w| w.so_far_ns >= OFF_CPU_LONG_NS) {
            let id = (wait.tid, wait.start_ns);
            let shipped = self.shipped_open.get(&id).copied().unwrap_or(0);
            let part = wait.so_far_ns.saturating_sub(shipped);
            if part == 0 {
                continue;
            }
            self.shipped_open.insert(id, wait.so_far_ns);
            let pending = self
                .pending
                .get(&wait.tid)
                .filter(|p| p.start_ns == wait.start_ns);
            parts.push(match pending {
                Some(pending) => OpenPart::WithStacks(pending.clone(), part),
                None => OpenPart::WithoutStacks(*wait, part),
            });
        }
        parts
    }

    /// Drops the waits of processes that exited (their end records will not come).
    pub fn forget_processes(&mut self, exited: &[u32]) {
        self.pending.retain(|_, wait| !exited.contains(&wait.tgid));
    }
}
