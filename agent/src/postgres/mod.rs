//! What pgscope knows about Postgres itself: which major a process runs, where a backend keeps
//! the state `pg_stat_activity` shows, and how to decode it. Everything that differs between
//! majors (offsets, enum values, the names of the globals read, probed functions' signatures)
//! lives in one table per major (`v14` … `v18`); this module picks one or refuses, and code asks
//! the table rather than comparing majors.

pub mod attribution;
pub mod backend_settings;
pub mod blockers;
pub mod catalog_columns;
pub mod instance_names;
pub mod memory;
pub mod pgss_counters;
pub mod pgss_hooks;
pub mod phase;
pub mod pointer_tables;
pub mod role_settings;
pub mod signatures;
pub mod sql;
pub mod stat_views;
pub mod status_slots;
pub mod subsystems;
pub mod v14;
pub mod v15;
pub mod v16;
pub mod v17;
pub mod v18;
pub mod wait_events;

#[cfg(test)]
mod header_check;

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};

use crate::bpf::abi::{Function, PgLayout, ProbeArgs};
pub use signatures::{ProbeSignature, SignatureError};
pub use status_slots::StatusSlots;

/// Decodes a `wait_event_info` value to `(wait_event_type, wait_event)`.
pub type WaitEventDecoder = fn(u32) -> Option<(&'static str, std::borrow::Cow<'static, str>)>;

/// Per-major knowledge: what the sampler, the statement clock, the instance names and the
/// function probes need to know of one major.
#[derive(Clone, Copy, Debug)]
pub struct VersionTable {
    pub major: u32,
    /// The exported globals a sample reads.
    pub sample_globals: SampleGlobals,
    /// Where a process's entry is in the shared status array, and how many entries it has.
    pub status_slots: StatusSlots,
    /// The exported globals the instance's own names are read through (`instance_names`).
    pub instance_name_globals: InstanceNameGlobals,
    /// The signature of each probeable function in this major; None where pgscope does not
    /// know it (the function is then not probed). Ask [`VersionTable::probe_args`].
    pub probe_signature: fn(Function) -> Option<ProbeSignature>,
    /// `offsetof(PgBackendStatus, st_changecount)`: bumped by every write of the backend's
    /// status (each statement's start and end), so its growth counts statements.
    pub st_changecount_offset: u32,
    /// `sizeof(PgBackendStatus)`: the stride of the shared status array.
    pub status_entry_size: u32,
    /// `offsetof(PgBackendStatus, st_state)`.
    pub st_state_offset: u32,
    /// `offsetof(PgBackendStatus, st_query_id)`.
    pub st_query_id_offset: u32,
    /// `offsetof(PgBackendStatus, st_activity_start_timestamp)`: when the current statement
    /// began, the same before and after its queryid is reported.
    pub st_activity_start_offset: u32,
    /// `offsetof(PgBackendStatus, st_userid)`: the session user the backend authenticated as,
    /// the role whose `ALTER ROLE … SET` settings it started with.
    pub st_userid_offset: u32,
    /// `STATE_IDLE`: 1, and 2 in 18 (`STATE_STARTING` came before it). With
    /// `wait_event_client_read`, what tells a backend idle between statements at switch-out.
    pub state_idle: u32,
    /// `WAIT_EVENT_CLIENT_READ` (generated, alphabetically, from 17 on).
    pub wait_event_client_read: u32,
    /// `B_BG_WORKER`: the `BackendType` of background workers, which `pg_stat_activity` names
    /// by their `bgw_type` instead.
    pub bg_worker_backend_type: u32,
    /// `offsetof(BackgroundWorker, bgw_type)` (`postmaster/bgworker.h`).
    pub bgw_type_offset: u32,
    /// `BGW_MAXLEN`: the size of the `bgw_type` array, NUL included.
    pub bgw_maxlen: u32,
    /// `PG_WAIT_LWLOCK`: the wait-event class of LWLock waits (`utils/wait_event.h`).
    pub pg_wait_lwlock: u32,
    /// `LWTRANCHE_FIRST_USER_DEFINED`: tranche ids from here on are assigned at run time, to
    /// extensions (`storage/lwlock.h`).
    pub lwtranche_first_user_defined: u32,
    /// `sizeof(NamedLWLockTranche)`, the stride of `NamedLWLockTrancheArray`.
    pub named_lwlock_tranche_size: u32,
    /// `offsetof(NamedLWLockTranche, trancheId)`.
    pub tranche_id_offset: u32,
    /// `offsetof(NamedLWLockTranche, trancheName)`.
    pub tranche_name_offset: u32,
    /// `plan_cache_mode`'s values in order (`PlanCacheMode`, `utils/plancache.h`), as `SHOW`
    /// names them; the GUC variable is the exported int `plan_cache_mode`.
    pub plan_cache_modes: [&'static str; 3],
    /// The tables of function pointers that name static functions of a stripped build
    /// (`pointer_tables`), generated into `vNN/pointer_tables.rs`.
    pub pointer_tables: &'static [symbolizer::PointerTable],
    /// Where a trigger function's call holds its trigger (`bpf/triggers.bpf.c`).
    pub triggers: TriggerLayout,
    pub backend_type_name: fn(u32) -> Option<&'static str>,
    pub backend_state_name: fn(u32) -> Option<&'static str>,
    pub wait_event_name: WaitEventDecoder,
    /// The major's own description of a wait event (`wait_event_type`, `wait_event`), where it
    /// has one (`pg_wait_events`, 17+).
    pub wait_event_description: fn(&str, &str) -> Option<&'static str>,
}

impl VersionTable {
    /// Where `function`'s probe reads its values in this major, or why it cannot be probed here.
    pub fn probe_args(&self, function: Function) -> Result<ProbeArgs, SignatureError> {
        // A function probed by name is counted and timed; none of its arguments is read, so
        // its signature does not matter.
        if function.is_named() {
            return Ok(ProbeArgs::default());
        }
        let signature = (self.probe_signature)(function).ok_or(SignatureError::Unknown {
            function: function.name(),
            major: self.major,
        })?;
        signature.probe_args(function, self.major)
    }
}

/// Names of the exported globals a sample reads: the addresses of [`PgLayout`].
#[derive(Clone, Copy, Debug)]
pub struct SampleGlobals {
    /// `PgBackendStatus *`: the process's own status entry.
    pub my_be_entry: &'static str,
    /// `uint32 *`: the current wait event.
    pub my_wait_event_info: &'static str,
    /// `BackendType`.
    pub my_backend_type: &'static str,
    /// `Oid`.
    pub my_database_id: &'static str,
}

impl SampleGlobals {
    fn names(&self) -> [&'static str; 4] {
        [
            self.my_be_entry,
            self.my_wait_event_info,
            self.my_backend_type,
            self.my_database_id,
        ]
    }
}

/// The sample globals' names, unchanged from 14 to 18 (each major's header test declares them
/// against its own headers, so a rename fails there).
pub(crate) const SAMPLE_GLOBALS_SINCE_14: SampleGlobals = SampleGlobals {
    my_be_entry: "MyBEEntry",
    my_wait_event_info: "my_wait_event_info",
    my_backend_type: "MyBackendType",
    my_database_id: "MyDatabaseId",
};

/// Where the trigger probes find the trigger a function is called for: the call's
/// `FunctionCallInfoBaseData.context` is a `TriggerData` (`commands/trigger.h`), whose
/// `tg_trigger` is the `Trigger` (`utils/reltrigger.h`) with its `pg_trigger` and
/// `pg_constraint` OIDs.
#[derive(Clone, Copy, Debug)]
pub struct TriggerLayout {
    /// `T_TriggerData`: the context's NodeTag (renumbered by most majors).
    pub trigger_data_tag: u32,
    /// `offsetof(FunctionCallInfoBaseData, context)`.
    pub fcinfo_context_offset: u8,
    /// `offsetof(TriggerData, tg_trigger)`.
    pub tg_trigger_offset: u8,
    /// `offsetof(Trigger, tgoid)`.
    pub tgoid_offset: u8,
    /// `offsetof(Trigger, tgconstraint)`.
    pub tgconstraint_offset: u8,
}

impl TriggerLayout {
    /// The offsets, unchanged from 14 to 18, with a major's `T_TriggerData`.
    pub(crate) const fn since_14(trigger_data_tag: u32) -> Self {
        TriggerLayout {
            trigger_data_tag,
            fcinfo_context_offset: 8,
            tg_trigger_offset: 32,
            tgoid_offset: 0,
            tgconstraint_offset: 36,
        }
    }
}

/// The exported functions around every trigger function's call (`ExecCallTriggerFunc`), which
/// the trigger probes are attached to: called with the call's `FunctionCallInfo` and usage
/// record, and with the same record when the call ends.
pub const TRIGGER_CALL_START: &str = "pgstat_init_function_usage";
pub const TRIGGER_CALL_END: &str = "pgstat_end_function_usage";

/// Names of the exported globals `instance_names` reads: the named LWLock tranches extensions
/// requested, and a background worker's own entry.
#[derive(Clone, Copy, Debug)]
pub struct InstanceNameGlobals {
    /// `NamedLWLockTranche *`.
    pub named_tranche_array: &'static str,
    /// `int`: the array's length.
    pub named_tranche_requests: &'static str,
    /// `BackgroundWorker *`.
    pub my_bgworker_entry: &'static str,
}

impl InstanceNameGlobals {
    pub fn names(&self) -> [&'static str; 3] {
        [
            self.named_tranche_array,
            self.named_tranche_requests,
            self.my_bgworker_entry,
        ]
    }
}

/// The instance-name globals' names, unchanged from 14 to 18 (checked like the sample globals').
pub(crate) const INSTANCE_NAME_GLOBALS_SINCE_14: InstanceNameGlobals = InstanceNameGlobals {
    named_tranche_array: "NamedLWLockTrancheArray",
    named_tranche_requests: "NamedLWLockTrancheRequests",
    my_bgworker_entry: "MyBgworkerEntry",
};

/// `PlanCacheMode` from 12 (when `plan_cache_mode` came) to 18; each major's header test
/// checks the values against its own headers.
pub(crate) const PLAN_CACHE_MODES_SINCE_12: [&str; 3] = ["auto", "force_generic_plan", "force_custom_plan"];

/// Every major's table.
const TABLES: [&VersionTable; 5] = [&v14::TABLE, &v15::TABLE, &v16::TABLE, &v17::TABLE, &v18::TABLE];

/// Majors whose offsets and enums are checked by the test suite against their own headers and
/// live servers: those with a table.
pub const SUPPORTED_MAJORS: &[u32] = &[v14::MAJOR, v15::MAJOR, v16::MAJOR, v17::MAJOR, v18::MAJOR];

/// The first major with `st_query_id`: older ones (end-of-life) cannot be attributed to queries.
const FIRST_MAJOR_WITH_QUERY_ID: u32 = 14;

/// The table for `major`, or an error saying what is supported.
pub fn table_for(major: u32) -> Result<&'static VersionTable> {
    match TABLES.into_iter().find(|table| table.major == major) {
        Some(table) => Ok(table),
        None if major < FIRST_MAJOR_WITH_QUERY_ID => bail!(
            "PostgreSQL {major} is not supported for query and wait-event attribution: it is \
             end-of-life and keeps no query id for its backends (`st_query_id` came in 14), so \
             pgscope reads none of its backends' state; stacks are still profiled, without queryid, \
             backend type, state or wait-event labels (supported: {SUPPORTED_MAJORS:?})"
        ),
        None => bail!(
            "PostgreSQL {major} is not supported for query and wait-event attribution yet (supported: \
             {SUPPORTED_MAJORS:?}); stacks are still profiled, without those labels"
        ),
    }
}

/// The major version a Postgres process runs: every Postgres process has its data directory as
/// working directory, and `PG_VERSION` there names the major.
pub fn detect_major(pid: u32) -> Result<u32> {
    let version_file = PathBuf::from(format!("/proc/{pid}/cwd/PG_VERSION"));
    let bytes = crate::input_file::read(&version_file, "PG_VERSION", PG_VERSION_MAX_BYTES)
        .with_context(|| format!("cannot read the data directory's PG_VERSION of PID {pid}"))?;
    major_of_pg_version(&bytes).ok_or_else(|| {
        anyhow!(
            "PG_VERSION of PID {pid} holds `{}`, not a major version",
            String::from_utf8_lossy(&bytes).trim().escape_debug()
        )
    })
}

/// The major in a `PG_VERSION` file (`15\n`).
pub(crate) fn major_of_pg_version(bytes: &[u8]) -> Option<u32> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

/// Largest `PG_VERSION` and `postmaster.pid` read (real ones hold a few bytes and about 100).
/// Both are read through the working directory of any process named `postgres`, which may be
/// anyone's (a container's): a FIFO there would stall the agent and `/dev/zero` fill its memory.
pub const PG_VERSION_MAX_BYTES: u64 = 64;
pub const PID_FILE_MAX_BYTES: u64 = 64 << 10;

/// The `postmaster.pid` of process `pid`'s data directory (its working directory), read only
/// when it is a regular file of at most [`PID_FILE_MAX_BYTES`].
pub fn read_pid_file(pid: u32) -> Result<String> {
    let path = PathBuf::from(format!("/proc/{pid}/cwd/postmaster.pid"));
    crate::input_file::read_to_string(&path, "postmaster.pid", PID_FILE_MAX_BYTES)
}

/// Runtime addresses of exported globals of a Postgres process's executable.
pub struct ExportedGlobals {
    pid: u32,
    addresses: std::collections::HashMap<String, u64>,
}

impl ExportedGlobals {
    /// Resolves `names` in the executable of process `pid` (they stay exported in stripped
    /// builds: extensions link against them).
    pub fn resolve(pid: u32, names: &[&str]) -> Result<Self> {
        let addresses = symbolizer::executable_globals(pid, names)
            .with_context(|| format!("reading the symbols of PID {pid}'s executable"))?;
        Ok(Self { pid, addresses })
    }

    /// The address of `name`, or an error naming it.
    pub fn address(&self, name: &str) -> Result<u64> {
        self.addresses.get(name).copied().ok_or_else(|| {
            anyhow!(
                "the postgres executable of PID {} exports no `{name}`; is it a PostgreSQL server of a \
                 supported major ({SUPPORTED_MAJORS:?})?",
                self.pid
            )
        })
    }
}

/// Where process `pid` keeps its pg_stat_activity state, and the table to decode it.
pub fn resolve_layout(pid: u32) -> Result<(PgLayout, &'static VersionTable)> {
    let table = table_for(detect_major(pid)?)?;
    let names = &table.sample_globals;
    let globals = ExportedGlobals::resolve(pid, &names.names())?;
    let layout = PgLayout {
        my_be_entry: globals.address(names.my_be_entry)?,
        my_wait_event_info: globals.address(names.my_wait_event_info)?,
        my_backend_type: globals.address(names.my_backend_type)?,
        my_database_id: globals.address(names.my_database_id)?,
        st_state_offset: table.st_state_offset,
        st_query_id_offset: table.st_query_id_offset,
        state_idle: table.state_idle,
        wait_client_read: table.wait_event_client_read,
        st_activity_start_offset: table.st_activity_start_offset,
        trigger_data_tag: table.triggers.trigger_data_tag,
        fcinfo_context_offset: table.triggers.fcinfo_context_offset,
        tg_trigger_offset: table.triggers.tg_trigger_offset,
        tgoid_offset: table.triggers.tgoid_offset,
        tgconstraint_offset: table.triggers.tgconstraint_offset,
        _pad: 0,
    };
    Ok((layout, table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_major_has_its_table_and_no_other() {
        for major in 0..100 {
            match table_for(major) {
                Ok(table) => {
                    assert_eq!(table.major, major);
                    assert!(SUPPORTED_MAJORS.contains(&major), "{major} has a table");
                }
                Err(error) => {
                    assert!(!SUPPORTED_MAJORS.contains(&major), "{major}: {error:#}");
                    let message = format!("{error:#}");
                    assert!(
                        message.contains(&format!("PostgreSQL {major} is not supported")),
                        "{message}"
                    );
                    assert!(message.contains("stacks are still profiled"), "{message}");
                    if major < 14 {
                        assert!(message.contains("end-of-life"), "{message}");
                        assert!(message.contains("`st_query_id` came in 14"), "{message}");
                    }
                }
            }
        }
        assert_eq!(SUPPORTED_MAJORS.len(), TABLES.len());
    }
}
