//! Names `pg_stat_activity` shows that live in the server's memory, not in the per-major tables:
//! the tranche names of LWLocks extensions requested (shared memory, read once per trace) and
//! the `bgw_type` of each background worker (the worker's own memory, read once per process).

use std::borrow::Cow;
use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};

use super::memory::{read_c_string, read_i32, read_u64};
use super::VersionTable;

/// Far more named tranches than any instance requests: a larger count is a misread.
const MAX_NAMED_TRANCHES: i32 = 10_000;

/// `RequestNamedLWLockTranche` copies a name into a `char[NAMEDATALEN]` (64 by default);
/// reading further is harmless, the NUL ends the string.
const MAX_TRANCHE_NAME: usize = 256;

/// `pgstat_get_wait_event` splits a `wait_event_info` into its class (top byte) and, for
/// LWLocks, the tranche id (low 16 bits); the same in every major with wait events.
const WAIT_CLASS_MASK: u32 = 0xFF00_0000;
const WAIT_EVENT_ID_MASK: u32 = 0x0000_FFFF;

/// The names one instance knows and the per-major tables do not.
#[derive(Debug, Default)]
pub struct InstanceNames {
    /// Tranche id → name, of the tranches requested with `RequestNamedLWLockTranche`.
    tranches: HashMap<u32, String>,
    /// Address of `MyBgworkerEntry`: the same in every process of the instance, which all are
    /// forked from the postmaster.
    my_bgworker_entry: Option<u64>,
    /// `bgw_type` per background worker PID, as far as it was read.
    worker_types: HashMap<u32, WorkerType>,
}

/// What is known of one background worker's `bgw_type`.
#[derive(Clone, Debug, PartialEq)]
enum WorkerType {
    /// Read (None: empty, or not read in [`WORKER_TYPE_TRIES`] tries: e.g. the worker exited
    /// before its samples were handled).
    Known(Option<String>),
    /// Reads that failed so far.
    Failed(u32),
}

/// Reads of a worker's `bgw_type` that may fail before it is labelled `background worker` for
/// good: one failed read once left a parallel worker unnamed for a whole trace.
const WORKER_TYPE_TRIES: u32 = 8;

impl InstanceNames {
    /// Reads the named tranches of the instance process `pid` belongs to (a backend, or the
    /// postmaster: its children inherit the array) and where background workers keep their
    /// entry.
    pub fn resolve(pid: u32, table: &VersionTable) -> Result<Self> {
        // Exported globals of the postgres executable, named by the major's table.
        let names = &table.instance_name_globals;
        let globals = super::ExportedGlobals::resolve(pid, &names.names())?;
        let tranches = read_named_tranches(
            pid,
            globals.address(names.named_tranche_array)?,
            globals.address(names.named_tranche_requests)?,
            table,
        )?;
        Ok(Self {
            tranches,
            my_bgworker_entry: Some(globals.address(names.my_bgworker_entry)?),
            worker_types: HashMap::new(),
        })
    }

    /// Names for tests elsewhere in the agent: no tranches, workers' entries at `address`.
    #[cfg(test)]
    pub fn with_worker_entry(address: u64) -> Self {
        Self {
            my_bgworker_entry: Some(address),
            ..Default::default()
        }
    }

    /// How many named tranches were read.
    pub fn tranche_count(&self) -> usize {
        self.tranches.len()
    }

    /// `(wait_event_type, wait_event)` as `pg_stat_activity` shows it: the per-major decoder,
    /// with an extension's tranche name where it would say "extension". Ids not requested by
    /// name (e.g. `LWLockNewTrancheId` + a backend-local registration) stay "extension", as in
    /// a backend that never registered them.
    pub fn wait_event(&self, table: &VersionTable, info: u32) -> Option<(&'static str, Cow<'static, str>)> {
        let (event_type, event) = (table.wait_event_name)(info)?;
        let tranche = info & WAIT_EVENT_ID_MASK;
        if info & WAIT_CLASS_MASK == table.pg_wait_lwlock && tranche >= table.lwtranche_first_user_defined {
            if let Some(name) = self.tranches.get(&tranche) {
                return Some((event_type, Cow::Owned(name.clone())));
            }
        }
        Some((event_type, event))
    }

    /// The `bgw_type` of background worker `pid` (e.g. "parallel worker"), read at its first
    /// sample and kept until [`InstanceNames::forget`]. None when unknown or empty; a read that
    /// fails is tried again at the worker's next samples, [`WORKER_TYPE_TRIES`] times in all.
    pub fn worker_type(&mut self, table: &VersionTable, pid: u32) -> Option<String> {
        let entry_global = self.my_bgworker_entry?;
        let failed = match self.worker_types.get(&pid) {
            Some(WorkerType::Known(name)) => return name.clone(),
            Some(WorkerType::Failed(failed)) => *failed,
            None => 0,
        };
        let (known, name) = match read_worker_type(pid, entry_global, table) {
            Ok(name) => {
                let name = Some(name).filter(|name| !name.is_empty());
                (WorkerType::Known(name.clone()), name)
            }
            Err(error) => {
                tracing::debug!(pid, failures = failed + 1, "no bgw_type: {error:#}");
                match failed + 1 {
                    tries if tries >= WORKER_TYPE_TRIES => (WorkerType::Known(None), None),
                    tries => (WorkerType::Failed(tries), None),
                }
            }
        };
        self.worker_types.insert(pid, known);
        name
    }

    /// Drops what is cached for an exited process: its PID may be reused by another.
    pub fn forget(&mut self, pid: u32) {
        self.worker_types.remove(&pid);
    }
}

/// `NamedLWLockTrancheArray[0 .. NamedLWLockTrancheRequests]` of process `pid`, given the
/// addresses of those two globals. The postmaster fills the array in shared memory at startup,
/// names included; before that (or without requests) the count is 0.
fn read_named_tranches(
    pid: u32,
    array_global: u64,
    count_global: u64,
    table: &VersionTable,
) -> Result<HashMap<u32, String>> {
    let count = read_i32(pid, count_global).context("reading NamedLWLockTrancheRequests")?;
    if count == 0 {
        return Ok(HashMap::new());
    }
    if !(1..=MAX_NAMED_TRANCHES).contains(&count) {
        bail!("NamedLWLockTrancheRequests of PID {pid} is {count}, not a number of tranches");
    }
    let array = read_u64(pid, array_global).context("reading NamedLWLockTrancheArray")?;
    if array == 0 {
        bail!("NamedLWLockTrancheArray of PID {pid} is null although {count} tranches were requested");
    }
    let mut tranches = HashMap::new();
    for index in 0..count as u64 {
        let element = array + index * u64::from(table.named_lwlock_tranche_size);
        let id = read_i32(pid, element + u64::from(table.tranche_id_offset))
            .with_context(|| format!("reading the id of named tranche {index}"))?;
        let id = u32::try_from(id).map_err(|_| anyhow!("named tranche {index} has id {id}"))?;
        let name = read_u64(pid, element + u64::from(table.tranche_name_offset))
            .and_then(|pointer| read_c_string(pid, pointer, MAX_TRANCHE_NAME))
            .with_context(|| format!("reading the name of tranche {id}"))?;
        tranches.insert(id, name);
    }
    Ok(tranches)
}

/// `MyBgworkerEntry->bgw_type` of process `pid`, given the address of `MyBgworkerEntry`.
fn read_worker_type(pid: u32, entry_global: u64, table: &VersionTable) -> Result<String> {
    let entry = read_u64(pid, entry_global).context("reading MyBgworkerEntry")?;
    if entry == 0 {
        bail!("PID {pid} has no MyBgworkerEntry");
    }
    read_c_string(
        pid,
        entry + u64::from(table.bgw_type_offset),
        table.bgw_maxlen as usize,
    )
    .context("reading MyBgworkerEntry->bgw_type")
}

#[cfg(test)]
mod tests {
    use std::ffi::c_char;

    use super::*;
    use crate::postgres::v15::TABLE;

    /// `NamedLWLockTranche` as the C compiler lays it out on 64-bit Linux (the layout
    /// `v15::TABLE` describes and its header test checks).
    #[repr(C)]
    struct NamedLWLockTranche {
        tranche_id: i32,
        tranche_name: *const c_char,
    }

    #[test]
    fn reads_named_tranches_from_process_memory() {
        let array = [
            NamedLWLockTranche {
                tranche_id: 75,
                tranche_name: c"pg_stat_statements".as_ptr(),
            },
            NamedLWLockTranche {
                tranche_id: 76,
                tranche_name: c"my_extension".as_ptr(),
            },
        ];
        assert_eq!(
            std::mem::size_of::<NamedLWLockTranche>(),
            TABLE.named_lwlock_tranche_size as usize
        );
        let array_global = array.as_ptr() as u64;
        let count_global: i32 = 2;
        let pid = std::process::id();
        let tranches = read_named_tranches(
            pid,
            &array_global as *const u64 as u64,
            &count_global as *const i32 as u64,
            &TABLE,
        )
        .expect("readable");
        assert_eq!(
            tranches,
            HashMap::from([
                (75, "pg_stat_statements".to_string()),
                (76, "my_extension".to_string())
            ])
        );

        let none: i32 = 0;
        let null: u64 = 0;
        let empty = read_named_tranches(
            pid,
            &null as *const u64 as u64,
            &none as *const i32 as u64,
            &TABLE,
        );
        assert!(empty.expect("no requests is no error").is_empty());
        let garbage: i32 = -3;
        assert!(read_named_tranches(
            pid,
            &array_global as *const u64 as u64,
            &garbage as *const i32 as u64,
            &TABLE
        )
        .is_err());
    }

    #[test]
    fn extension_tranches_are_named_and_others_are_left_alone() {
        let names = InstanceNames {
            // 8 cannot be a named tranche (it is WALWrite); a misread must not rename it.
            tranches: HashMap::from([(75, "pg_stat_statements".to_string()), (8, "bogus".to_string())]),
            ..Default::default()
        };
        let event = |info| names.wait_event(&TABLE, info).map(|(t, e)| (t, e.into_owned()));
        assert_eq!(event(0x0100_004B), Some(("LWLock", "pg_stat_statements".into())));
        assert_eq!(event(0x0100_004C), Some(("LWLock", "extension".into())));
        assert_eq!(event(0x0100_0008), Some(("LWLock", "WALWrite".into())));
        // Another class with the same low bits.
        assert_eq!(event(0x0300_004B), Some(("Lock", "unknown:0x0300004b".into())));
        assert_eq!(event(0), None);
    }

    #[test]
    fn reads_bgw_type_once_per_process() {
        // A BackgroundWorker's leading bytes: bgw_name, then bgw_type.
        let mut worker = vec![0u8; (TABLE.bgw_type_offset + TABLE.bgw_maxlen) as usize];
        let offset = TABLE.bgw_type_offset as usize;
        worker[..8].copy_from_slice(b"worker 1");
        worker[offset..offset + 15].copy_from_slice(b"parallel worker");
        let entry_global = std::hint::black_box(worker.as_ptr()) as u64;
        let pid = std::process::id();
        let mut names = InstanceNames {
            my_bgworker_entry: Some(&entry_global as *const u64 as u64),
            ..Default::default()
        };
        assert_eq!(names.worker_type(&TABLE, pid).as_deref(), Some("parallel worker"));
        // Cached: a change in memory is not seen until the process is forgotten.
        worker[offset..offset + 15].copy_from_slice(b"logical replica");
        std::hint::black_box(&worker);
        assert_eq!(names.worker_type(&TABLE, pid).as_deref(), Some("parallel worker"));
        names.forget(pid);
        assert_eq!(names.worker_type(&TABLE, pid).as_deref(), Some("logical replica"));

        let null: u64 = 0;
        let mut unread = InstanceNames {
            my_bgworker_entry: Some(&null as *const u64 as u64),
            ..Default::default()
        };
        assert_eq!(unread.worker_type(&TABLE, pid), None);
        assert_eq!(InstanceNames::default().worker_type(&TABLE, pid), None);
    }

    #[test]
    fn a_failed_read_of_bgw_type_is_tried_again_a_few_times() {
        let mut worker = vec![0u8; (TABLE.bgw_type_offset + TABLE.bgw_maxlen) as usize];
        let offset = TABLE.bgw_type_offset as usize;
        worker[offset..offset + 15].copy_from_slice(b"parallel worker");
        let mut entry: u64 = 0;
        let entry_global = std::hint::black_box(&mut entry as *mut u64) as u64;
        let pid = std::process::id();
        let mut names = InstanceNames {
            my_bgworker_entry: Some(entry_global),
            ..Default::default()
        };
        // Not set yet (the worker has no entry): not known, and not given up on.
        assert_eq!(names.worker_type(&TABLE, pid), None);
        entry = std::hint::black_box(worker.as_ptr()) as u64;
        std::hint::black_box(&entry);
        assert_eq!(names.worker_type(&TABLE, pid).as_deref(), Some("parallel worker"));
        // Given up on after WORKER_TYPE_TRIES failures.
        let mut never = InstanceNames {
            my_bgworker_entry: Some(std::hint::black_box(&0u64 as *const u64) as u64),
            ..Default::default()
        };
        for _ in 0..WORKER_TYPE_TRIES {
            assert_eq!(never.worker_type(&TABLE, pid), None);
        }
        assert_eq!(never.worker_types.get(&pid), Some(&WorkerType::Known(None)));
    }
}
