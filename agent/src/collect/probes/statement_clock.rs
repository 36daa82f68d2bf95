//! Counts the statements an instance's backends run, to scale duty-cycled probe counts. A probe
//! attached only part of the time sees the workload while it slows it: scaling its calls by
//! time would extrapolate the slower rate (measured here: ~30% low for LockRelationOid). Scaled
//! by statements instead — calls while attached × all statements / statements while attached —
//! the estimate is right whenever calls per statement do not depend on whether the probe is
//! attached, which is what a probe measures.
//!
//! The count is the sum of `st_changecount` over the instance's whole PgBackendStatus array in
//! shared memory: every status write bumps it, at least one at each statement's start and end.
//! Reading every slot (one `pread` of the array per tick, from any process of the instance),
//! rather than each backend's own entry, keeps the count continuous: a backend that connects
//! mid-trace takes a slot whose counter goes on from its previous occupant's, so none of its
//! statements is missed between its start and its first read.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::bpf::abi::PgLayout;
use crate::postgres::memory::read_u64;
use crate::postgres::status_slots::SlotGlobals;
use crate::postgres::VersionTable;

/// Where the status array is, from the exported globals of the postmaster's executable (every
/// process of an instance maps it at the same address) and the version table.
#[derive(Clone, Copy, Debug)]
pub struct CounterLayout {
    /// `&MyBEEntry`: a process's own slot.
    pub my_be_entry: u64,
    /// What places that slot in the array, by the major's rule.
    pub slots: SlotGlobals,
    /// `sizeof(PgBackendStatus)`.
    pub entry_size: u32,
    /// `offsetof(PgBackendStatus, st_changecount)`.
    pub st_changecount_offset: u32,
}

impl CounterLayout {
    /// The layout of the instance `pid` belongs to: the attribution layout's `MyBEEntry`, the
    /// exported globals that place a process in the array, and the version's sizes.
    pub fn for_process(pid: u32, layout: &PgLayout, table: &VersionTable) -> anyhow::Result<Self> {
        Ok(Self {
            my_be_entry: layout.my_be_entry,
            slots: table.status_slots.resolve(pid)?,
            entry_size: table.status_entry_size,
            st_changecount_offset: table.st_changecount_offset,
        })
    }
}

#[derive(Debug)]
struct StatusArray {
    base: u64,
    slots: usize,
    last: Vec<u32>,
}

/// Statement progress of an instance between reads.
#[derive(Debug)]
pub struct StatementClock {
    layout: CounterLayout,
    array: Option<StatusArray>,
}

impl StatementClock {
    pub fn new(layout: CounterLayout) -> Self {
        Self { layout, array: None }
    }

    /// Whether it counts: the array was found and read once (until then every call returns 0,
    /// and statements run meanwhile are not counted anywhere).
    pub fn is_counting(&self) -> bool {
        self.array.as_ref().is_some_and(|array| !array.last.is_empty())
    }

    /// Status writes of the whole instance since the previous call, read through one of `pids`
    /// (processes of the instance). The first successful read only sets the starting point.
    pub fn advance(&mut self, pids: &[u32]) -> u64 {
        if self.array.is_none() {
            self.array = pids.iter().find_map(|&pid| self.locate(pid));
        }
        let Some(array) = self.array.as_mut() else {
            return 0;
        };
        let layout = self.layout;
        let Some(now) = pids.iter().find_map(|&pid| read_counters(pid, array, layout)) else {
            return 0;
        };
        let progress = if array.last.len() == now.len() {
            // C ints that wrap: the difference modulo 2^32 is the progress.
            now.iter()
                .zip(&array.last)
                .map(|(value, before)| u64::from(value.wrapping_sub(*before)))
                .sum()
        } else {
            0
        };
        array.last = now;
        progress
    }

    /// The array, from process `pid`'s own slot and its index; None for processes without a
    /// slot (the postmaster, a backend still starting) or gone.
    fn locate(&self, pid: u32) -> Option<StatusArray> {
        let l = self.layout;
        let entry = read_u64(pid, l.my_be_entry).ok().filter(|&e| e != 0)?;
        let int_at = |address: u64| read_u64(pid, address).ok().map(|v| v as u32 as i32);
        let (index, slots) = l.slots.locate(int_at)?;
        let base = entry.checked_sub(u64::try_from(index).ok()? * u64::from(l.entry_size))?;
        Some(StatusArray {
            base,
            slots,
            last: Vec::new(),
        })
    }
}

/// Every slot's `st_changecount`, read in one go from process `pid`'s view of shared memory.
fn read_counters(pid: u32, array: &StatusArray, layout: CounterLayout) -> Option<Vec<u32>> {
    let size = layout.entry_size as usize;
    let mut bytes = vec![0u8; array.slots * size];
    let mem = File::open(format!("/proc/{pid}/mem")).ok()?;
    mem.read_exact_at(&mut bytes, array.base).ok()?;
    let offset = layout.st_changecount_offset as usize;
    bytes
        .chunks_exact(size)
        .map(|slot| {
            let word = slot.get(offset..offset + 4)?;
            Some(u32::from_ne_bytes(word.try_into().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::status_slots::SlotIndex;

    /// This process stands in for an instance: a status array of 3 backend slots and 1 aux
    /// slot, 16-byte entries with the counter at offset 4, and the globals of a backend in slot 2.
    #[test]
    fn counts_every_slot_from_one_backend_and_keeps_slots_across_occupants() {
        let mut array = [[0u32; 4]; 4];
        array[0][1] = 10;
        array[1][1] = u32::MAX;
        let my_be_entry = Box::new(array[1].as_ptr() as u64);
        let my_backend_id = Box::new(2u64);
        let max_backends = Box::new(3u64);
        let my_aux_proc_type = Box::new(u64::MAX);
        let layout = CounterLayout {
            my_be_entry: &*my_be_entry as *const u64 as u64,
            slots: SlotGlobals {
                index: SlotIndex::BackendIdThenAuxType {
                    backend_id: &*my_backend_id as *const u64 as u64,
                    aux_proc_type: &*my_aux_proc_type as *const u64 as u64,
                },
                max_backends: &*max_backends as *const u64 as u64,
                aux_slots: 1,
            },
            entry_size: 16,
            st_changecount_offset: 4,
        };
        let pid = std::process::id();
        let mut clock = StatementClock::new(layout);
        assert_eq!(
            clock.advance(&[u32::MAX - 2, pid]),
            0,
            "the first read is the starting point"
        );
        // SAFETY: `array` is alive and only this thread touches it; volatile because the clock
        // reads it through /proc/self/mem, behind the compiler's back.
        unsafe {
            std::ptr::write_volatile(&mut array[0][1], 14); // another backend: +4
            std::ptr::write_volatile(&mut array[1][1], 1); // this one wraps: +2
            std::ptr::write_volatile(&mut array[3][1], 6); // the aux slot: +6
        }
        assert_eq!(clock.advance(&[pid]), 12);
        assert_eq!(clock.advance(&[pid]), 0);
    }

    #[test]
    fn a_process_without_a_status_entry_locates_nothing() {
        let null = Box::new(0u64);
        let address = &*null as *const u64 as u64;
        let mut clock = StatementClock::new(CounterLayout {
            my_be_entry: address,
            slots: SlotGlobals {
                index: SlotIndex::ProcNumber { proc_number: address },
                max_backends: address,
                aux_slots: 6,
            },
            entry_size: 16,
            st_changecount_offset: 0,
        });
        assert_eq!(clock.advance(&[std::process::id()]), 0);
        assert!(clock.array.is_none());
    }
}
