//! Decoding what a sample read from the backend's memory into the labels `pg_stat_activity`
//! would show: backend type, database, state, queryid and wait event.

use std::borrow::Cow;

use super::VersionTable;
use crate::bpf::abi::{SampleHeader, ATTR_BACKEND_TYPE, ATTR_DATABASE, ATTR_STATUS, ATTR_WAIT_EVENT};

/// A backend's state at one sample. Part of the aggregation key, so it stays small and hashable.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Attribution {
    pub backend_type: Option<&'static str>,
    /// OID of the connected database (`MyDatabaseId`); 0 for processes not connected to one.
    pub database_oid: Option<u32>,
    pub state: Option<&'static str>,
    /// `pg_stat_activity.query_id` / `pg_stat_statements.queryid` (signed, as SQL shows it); 0
    /// when not computed for the current statement.
    pub query_id: Option<i64>,
    /// `(wait_event_type, wait_event)`.
    pub wait_event: Option<(&'static str, Cow<'static, str>)>,
}

impl Attribution {
    /// Decodes the attribution fields of a sample; fields the sample could not read stay `None`.
    pub fn decode(header: &SampleHeader, table: &VersionTable) -> Self {
        let has = |flag: u32| header.attribution & flag != 0;
        let status = has(ATTR_STATUS);
        let backend_type = has(ATTR_BACKEND_TYPE)
            .then(|| (table.backend_type_name)(header.backend_type))
            .flatten();
        // Only statements run queries: client backends and the parallel workers (background
        // workers) that carry their leader's queryid. Auxiliary processes have status entries
        // too, with a queryid that is always 0.
        let runs_queries = matches!(backend_type, Some("client backend" | "background worker"));
        Self {
            backend_type,
            database_oid: has(ATTR_DATABASE).then_some(header.database_id),
            state: status
                .then(|| (table.backend_state_name)(header.backend_state))
                .flatten(),
            // PG14-17 keep it as uint64 and SQL shows it as bigint: same bits, signed.
            query_id: (status && runs_queries).then_some(header.query_id as i64),
            wait_event: has(ATTR_WAIT_EVENT)
                .then(|| (table.wait_event_name)(header.wait_event_info))
                .flatten(),
        }
    }

    /// The sample labels, with the names used in every output (pprof, Pyroscope).
    pub fn push_labels(&self, labels: &mut Vec<(String, String)>) {
        if let Some(backend_type) = self.backend_type {
            labels.push(("backend_type".into(), backend_type.into()));
        }
        if let Some(oid) = self.database_oid.filter(|&oid| oid != 0) {
            labels.push(("database".into(), oid.to_string()));
        }
        if let Some(state) = self.state {
            labels.push(("state".into(), state.into()));
        }
        if let Some(query_id) = self.query_id {
            labels.push(("queryid".into(), query_id.to_string()));
        }
        if let Some((kind, name)) = &self.wait_event {
            labels.push(("wait_event".into(), format!("{kind}:{name}")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::abi::KERNEL_FRAMES_MAX;

    fn header(attribution: u32) -> SampleHeader {
        SampleHeader {
            tgid: 1,
            tid: 1,
            time_ns: 0,
            cpu: 0,
            kernel_frames: 0,
            user_ip: 0,
            user_sp: 0,
            user_bp: 0,
            user_stack_len: 0,
            query_id: (-42i64) as u64,
            wait_event_info: 0x0A00_0011,
            backend_type: 3,
            database_id: 16384,
            backend_state: 2,
            attribution,
            off_cpu_class: 0,
            off_cpu_ns: 0,
            off_cpu_syscall: 0,
            _pad: 0,
            kernel_stack: [0; KERNEL_FRAMES_MAX],
        }
    }

    #[test]
    fn decodes_every_field_that_was_read() {
        let all = ATTR_BACKEND_TYPE | ATTR_DATABASE | ATTR_STATUS | ATTR_WAIT_EVENT;
        let attribution = Attribution::decode(&header(all), &crate::postgres::v15::TABLE);
        assert_eq!(attribution.backend_type, Some("client backend"));
        assert_eq!(attribution.database_oid, Some(16384));
        assert_eq!(attribution.state, Some("active"));
        assert_eq!(attribution.query_id, Some(-42));
        assert_eq!(
            attribution.wait_event,
            Some(("IO", Cow::Borrowed("DataFileRead")))
        );
        let mut labels = Vec::new();
        attribution.push_labels(&mut labels);
        assert!(labels.contains(&("queryid".into(), "-42".into())));
        assert!(labels.contains(&("wait_event".into(), "IO:DataFileRead".into())));
    }

    #[test]
    fn auxiliary_processes_get_no_queryid() {
        let mut walwriter = header(ATTR_BACKEND_TYPE | ATTR_STATUS);
        walwriter.backend_type = 10;
        walwriter.query_id = 0;
        let attribution = Attribution::decode(&walwriter, &crate::postgres::v15::TABLE);
        assert_eq!(attribution.backend_type, Some("walwriter"));
        assert_eq!(attribution.query_id, None);
    }

    #[test]
    fn fields_not_read_are_absent() {
        let attribution = Attribution::decode(&header(ATTR_BACKEND_TYPE), &crate::postgres::v15::TABLE);
        assert_eq!(attribution.backend_type, Some("client backend"));
        assert_eq!(attribution.query_id, None);
        assert_eq!(attribution.state, None);
        assert_eq!(attribution.wait_event, None);
        assert_eq!(attribution.database_oid, None);
    }
}
