//! Where a process's own entry sits in the shared status array (`BackendStatusArray`, one
//! `PgBackendStatus` per backend and auxiliary process) and how many entries the array has. The
//! statement clock reads every entry; the rule that places a process changed in 17.

use anyhow::Result;

use super::ExportedGlobals;

/// One major's rule, with the names of the exported globals it reads.
#[derive(Clone, Copy, Debug)]
pub enum StatusSlots {
    /// 14–16 (`pgstat_beinit`): a backend's entry is `MyBackendId - 1`, an auxiliary process's
    /// (`MyBackendId` is 0 there) `MaxBackends + MyAuxProcType`; the array has
    /// `MaxBackends + NUM_AUXPROCTYPES` entries.
    BackendIdThenAuxType {
        backend_id: &'static str,
        aux_proc_type: &'static str,
        max_backends: &'static str,
        /// `NUM_AUXPROCTYPES`.
        aux_slots: u32,
    },
    /// 17 on (`pgstat_beinit`): every process's entry is `MyProcNumber`, auxiliary processes'
    /// numbers following the backends'; the array has `MaxBackends + NUM_AUXILIARY_PROCS`
    /// entries (`NumBackendStatSlots`).
    ProcNumber {
        proc_number: &'static str,
        max_backends: &'static str,
        /// `NUM_AUXILIARY_PROCS`.
        aux_slots: u32,
    },
}

impl StatusSlots {
    /// The entries after the `MaxBackends` backends', for the header tests.
    #[cfg(test)]
    pub fn aux_slots(&self) -> u32 {
        match *self {
            Self::BackendIdThenAuxType { aux_slots, .. } | Self::ProcNumber { aux_slots, .. } => aux_slots,
        }
    }

    /// The exported globals the rule reads.
    pub fn global_names(&self) -> Vec<&'static str> {
        match *self {
            Self::BackendIdThenAuxType {
                backend_id,
                aux_proc_type,
                max_backends,
                ..
            } => vec![backend_id, aux_proc_type, max_backends],
            Self::ProcNumber {
                proc_number,
                max_backends,
                ..
            } => vec![proc_number, max_backends],
        }
    }

    /// The C constant `aux_slots` holds, for the header tests.
    #[cfg(test)]
    pub fn aux_slots_constant(&self) -> &'static str {
        match self {
            Self::BackendIdThenAuxType { .. } => "NUM_AUXPROCTYPES",
            Self::ProcNumber { .. } => "NUM_AUXILIARY_PROCS",
        }
    }

    /// The rule with its globals' addresses in process `pid`'s executable.
    pub fn resolve(&self, pid: u32) -> Result<SlotGlobals> {
        let globals = ExportedGlobals::resolve(pid, &self.global_names())?;
        Ok(match *self {
            Self::BackendIdThenAuxType {
                backend_id,
                aux_proc_type,
                max_backends,
                aux_slots,
            } => SlotGlobals {
                index: SlotIndex::BackendIdThenAuxType {
                    backend_id: globals.address(backend_id)?,
                    aux_proc_type: globals.address(aux_proc_type)?,
                },
                max_backends: globals.address(max_backends)?,
                aux_slots,
            },
            Self::ProcNumber {
                proc_number,
                max_backends,
                aux_slots,
            } => SlotGlobals {
                index: SlotIndex::ProcNumber {
                    proc_number: globals.address(proc_number)?,
                },
                max_backends: globals.address(max_backends)?,
                aux_slots,
            },
        })
    }
}

/// A rule with addresses: what locates the array from inside one of an instance's processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotGlobals {
    pub index: SlotIndex,
    /// `&MaxBackends`.
    pub max_backends: u64,
    pub aux_slots: u32,
}

/// The addresses of the `int` globals that give a process's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotIndex {
    BackendIdThenAuxType { backend_id: u64, aux_proc_type: u64 },
    ProcNumber { proc_number: u64 },
}

impl SlotGlobals {
    /// The process's own index and the array's length, reading its `int` globals through
    /// `read_int`; None for a process without an entry (the postmaster, a backend starting) or
    /// values outside the array.
    pub fn locate(&self, read_int: impl Fn(u64) -> Option<i32>) -> Option<(usize, usize)> {
        let max_backends = usize::try_from(read_int(self.max_backends)?).ok()?;
        let index = match self.index {
            SlotIndex::BackendIdThenAuxType {
                backend_id,
                aux_proc_type,
            } => {
                let backend_id = read_int(backend_id)?;
                if backend_id > 0 {
                    usize::try_from(backend_id - 1).ok()?
                } else {
                    max_backends + usize::try_from(read_int(aux_proc_type)?).ok()?
                }
            }
            SlotIndex::ProcNumber { proc_number } => usize::try_from(read_int(proc_number)?).ok()?,
        };
        let slots = max_backends + self.aux_slots as usize;
        (index < slots).then_some((index, slots))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn reader(values: &[(u64, i32)]) -> impl Fn(u64) -> Option<i32> {
        let values: HashMap<u64, i32> = values.iter().copied().collect();
        move |address| values.get(&address).copied()
    }

    const BY_BACKEND_ID: SlotGlobals = SlotGlobals {
        index: SlotIndex::BackendIdThenAuxType {
            backend_id: 1,
            aux_proc_type: 2,
        },
        max_backends: 3,
        aux_slots: 6,
    };

    const BY_PROC_NUMBER: SlotGlobals = SlotGlobals {
        index: SlotIndex::ProcNumber { proc_number: 1 },
        max_backends: 3,
        aux_slots: 38,
    };

    #[test]
    fn backends_before_auxiliary_processes_until_16() {
        let backend = reader(&[(1, 4), (2, -1), (3, 100)]);
        assert_eq!(BY_BACKEND_ID.locate(backend), Some((3, 106)));
        let checkpointer = reader(&[(1, 0), (2, 3), (3, 100)]);
        assert_eq!(BY_BACKEND_ID.locate(checkpointer), Some((103, 106)));
        let postmaster = reader(&[(1, 0), (2, -1), (3, 100)]);
        assert_eq!(BY_BACKEND_ID.locate(postmaster), None);
        let past_the_end = reader(&[(1, 0), (2, 6), (3, 100)]);
        assert_eq!(BY_BACKEND_ID.locate(past_the_end), None);
    }

    #[test]
    fn every_process_at_its_proc_number_from_17() {
        assert_eq!(BY_PROC_NUMBER.locate(reader(&[(1, 0), (3, 100)])), Some((0, 138)));
        assert_eq!(
            BY_PROC_NUMBER.locate(reader(&[(1, 137), (3, 100)])),
            Some((137, 138))
        );
        // INVALID_PROC_NUMBER (-1): the postmaster; a prepared transaction's number is past
        // the array.
        assert_eq!(BY_PROC_NUMBER.locate(reader(&[(1, -1), (3, 100)])), None);
        assert_eq!(BY_PROC_NUMBER.locate(reader(&[(1, 138), (3, 100)])), None);
        assert_eq!(BY_PROC_NUMBER.locate(reader(&[(3, 100)])), None, "unreadable");
    }
}
