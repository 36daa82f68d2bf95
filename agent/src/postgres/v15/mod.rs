//! PostgreSQL 15. Offsets are `offsetof` in the server headers (`postgresql-server-dev-15`,
//! `utils/backend_status.h`); the `pg15_layout` integration test recomputes them with a C
//! program and checks decoded values against `pg_stat_activity` of live backends.

pub mod names;

use super::VersionTable;

pub static TABLE: VersionTable = VersionTable {
    major: 15,
    st_state_offset: 232,
    st_query_id_offset: 424,
    backend_type_name: names::backend_type,
    backend_state_name: names::backend_state,
    wait_event_name: names::wait_event,
};
