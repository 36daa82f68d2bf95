//! What lets the off-CPU sampler leave idle backends alone: each tick, one read of every
//! watched instance's status array (`PgBackendStatus` per backend, in shared memory) tells
//! which processes wrote their status since the last tick. A client backend idle between
//! statements writes its status before it does anything else (the next statement's start), so
//! one whose entry did not change is still idle: the sampler's BPF passes park such a backend
//! and visit only the processes listed here as woken (`bpf/wait_sampler.bpf.h`). Every
//! [`WALK_EVERY`] ticks, and whenever an array cannot be read or compared, the passes walk
//! every thread instead, as without parking.
//!
//! An instance is watched from before its processes become targets ([`WatchList::watch`]), so
//! that none of its backends is parked while nobody reads its array.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use tracing::debug;

use super::probes::statement_clock::CounterLayout;
use crate::target;

/// Ticks between walks of every thread: a parked backend's ticks are added to its total at
/// each (its total lags by this many ticks at most), and a process the arrays do not show
/// (the postmaster, the logger) is found by them.
pub const WALK_EVERY: u64 = 32;

/// The instances whose status arrays the sampler reads, by root PID (the postmaster, or the
/// one backend traced), shared with the sampler's thread.
#[derive(Clone, Debug, Default)]
pub struct WatchList {
    inner: Arc<Mutex<Watched>>,
}

#[derive(Debug, Default)]
struct Watched {
    /// Bumped at each change: the sampler reads the arrays afresh.
    generation: u64,
    /// None: an instance with attribution whose array cannot be located (its executable lacks
    /// the globals that place a process in it): nothing may be parked while it is watched.
    instances: BTreeMap<u32, Option<CounterLayout>>,
}

impl WatchList {
    /// Watches the instance of `root`, whose array is located through `layout`.
    pub fn watch(&self, root: u32, layout: Option<CounterLayout>) {
        if let Ok(mut watched) = self.inner.lock() {
            watched.instances.insert(root, layout);
            watched.generation += 1;
        }
    }

    /// Stops watching an instance (gone, or no longer profiled).
    pub fn unwatch(&self, root: u32) {
        if let Ok(mut watched) = self.inner.lock() {
            if watched.instances.remove(&root).is_some() {
                watched.generation += 1;
            }
        }
    }

    fn snapshot(&self) -> Option<(u64, Vec<WatchedInstance>)> {
        let watched = self.inner.lock().ok()?;
        Some((
            watched.generation,
            watched
                .instances
                .iter()
                .map(|(&root, &layout)| (root, layout))
                .collect(),
        ))
    }
}

/// An instance's root PID and what locates its array.
type WatchedInstance = (u32, Option<CounterLayout>);

/// What one run of the sampler's passes does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickPlan {
    /// Walk every thread of the host.
    pub walk: bool,
    /// Every watched array was read at this tick and the last: idle backends may be parked.
    pub park: bool,
    /// Processes whose status entry changed since the last tick (for a run that does not walk).
    pub woken: Vec<u32>,
}

/// Slots read past the highest one in use: a backend that starts takes the lowest free slot,
/// so the ones it may take are in the read, and the next read goes as far again past it.
const SLOTS_PAST_HIGHEST: usize = 64;

/// One instance's array as read at the last tick.
#[derive(Debug)]
struct Array {
    base: u64,
    slots: usize,
    mem: File,
    /// Each slot's (`st_procpid`, `st_changecount`) at the last tick, as far as it was read.
    last: Option<Vec<(u32, u32)>>,
}

impl Array {
    /// Slots to read at this tick: up to [`SLOTS_PAST_HIGHEST`] past the highest one in use at
    /// the last, or all of them (the first read, and at each walk). What is read grows with the
    /// backends, not with `max_connections`.
    fn to_read(&self, full: bool) -> usize {
        match (&self.last, full) {
            (Some(last), false) => {
                let highest = last.iter().rposition(|&(pid, _)| pid != 0).map_or(0, |i| i + 1);
                (highest + SLOTS_PAST_HIGHEST).min(self.slots)
            }
            _ => self.slots,
        }
    }
}

/// The sampler's side: reads the arrays each tick and plans the run.
#[derive(Debug)]
pub struct StatusWatch {
    list: WatchList,
    generation: u64,
    arrays: BTreeMap<u32, Option<Array>>,
    ticks: u64,
    buffer: Vec<u8>,
    /// Most processes a run that does not walk may visit as woken.
    woken_max: usize,
}

impl StatusWatch {
    pub fn new(list: WatchList, woken_max: usize) -> Self {
        Self {
            list,
            generation: u64::MAX,
            arrays: BTreeMap::new(),
            ticks: 0,
            buffer: Vec::new(),
            woken_max,
        }
    }

    /// Reads every watched array and plans this tick's run.
    pub fn plan(&mut self) -> TickPlan {
        self.ticks += 1;
        let Some((generation, instances)) = self.list.snapshot() else {
            return walk_only();
        };
        if generation != self.generation {
            // Arrays of instances kept are still valid; their last reads are compared as ever.
            self.arrays
                .retain(|root, _| instances.iter().any(|(r, _)| r == root));
            self.generation = generation;
        }
        let mut every_read = true;
        let mut compared = true;
        let mut woken = Vec::new();
        for (root, layout) in instances {
            let Some(layout) = layout else {
                every_read = false;
                continue;
            };
            let slot = self.arrays.entry(root).or_insert(None);
            if slot.is_none() {
                *slot = locate(root, &layout);
                debug!(
                    root,
                    found = slot.is_some(),
                    "locating the instance's status array"
                );
            }
            let Some(array) = slot.as_mut() else {
                every_read = false;
                continue;
            };
            let full = (self.ticks + 1).is_multiple_of(WALK_EVERY);
            match read_slots(array, array.to_read(full), &layout, &mut self.buffer) {
                Some(now) => {
                    match &array.last {
                        Some(last) => woken.extend(changed(last, &now)),
                        None => compared = false,
                    }
                    array.last = Some(now);
                }
                None => {
                    // Gone or moved (a restart): located again next tick.
                    *slot = None;
                    every_read = false;
                }
            }
        }
        let walk =
            !every_read || !compared || woken.len() > self.woken_max || self.ticks.is_multiple_of(WALK_EVERY);
        TickPlan {
            walk,
            park: every_read,
            woken: if walk { Vec::new() } else { woken },
        }
    }
}

fn walk_only() -> TickPlan {
    TickPlan {
        walk: true,
        park: false,
        woken: Vec::new(),
    }
}

/// The array of `root`'s instance, located through any of its processes with a slot, read
/// through `root` (every process of an instance maps it at the same address).
fn locate(root: u32, layout: &CounterLayout) -> Option<Array> {
    let candidates = std::iter::once(root).chain(target::children_of(root).into_iter().map(|c| c.pid));
    let (base, slots) = candidates.into_iter().find_map(|pid| layout.locate(pid))?;
    let mem = File::open(format!("/proc/{root}/mem")).ok()?;
    Some(Array {
        base,
        slots,
        mem,
        last: None,
    })
}

/// The first `slots` slots' (`st_procpid`, `st_changecount`), in one read of the array.
fn read_slots(
    array: &Array,
    slots: usize,
    layout: &CounterLayout,
    buffer: &mut Vec<u8>,
) -> Option<Vec<(u32, u32)>> {
    let size = layout.entry_size as usize;
    buffer.resize(slots.min(array.slots).checked_mul(size)?, 0);
    array.mem.read_exact_at(buffer, array.base).ok()?;
    let word = |slot: &[u8], offset: u32| -> Option<u32> {
        let offset = offset as usize;
        Some(u32::from_ne_bytes(slot.get(offset..offset + 4)?.try_into().ok()?))
    };
    buffer
        .chunks_exact(size)
        .map(|slot| {
            Some((
                word(slot, layout.st_procpid_offset)?,
                word(slot, layout.st_changecount_offset)?,
            ))
        })
        .collect()
}

/// The processes in slots that changed between two reads: a new occupant, or a status write
/// (an odd count is a write in progress: changed too). A slot not read the last time counts as
/// changed.
fn changed<'a>(last: &'a [(u32, u32)], now: &'a [(u32, u32)]) -> impl Iterator<Item = u32> + 'a {
    now.iter()
        .enumerate()
        .filter(|&(i, after)| last.get(i) != Some(after) || after.1 % 2 == 1)
        .map(|(_, &(pid, _))| pid)
        .filter(|&pid| pid != 0)
}

#[cfg(test)]
mod tests;
