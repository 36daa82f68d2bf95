//! Decoding what a sample read from the backend's memory into the labels `pg_stat_activity`
//! would show: backend type, database, state, queryid and wait event; and the trigger the
//! backend ran, which no view shows.

use std::borrow::Cow;
use std::collections::HashMap;

use super::instance_names::InstanceNames;
use super::VersionTable;
use crate::bpf::abi::{SampleHeader, ATTR_BACKEND_TYPE, ATTR_DATABASE, ATTR_STATUS, ATTR_WAIT_EVENT};
use crate::model::labels as label;

/// A backend's state at one sample. Part of the aggregation key, so it stays small and hashable.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Attribution {
    /// `pg_stat_activity.backend_type`: a background worker's own `bgw_type` when it could be
    /// read (owned), otherwise the name of its `BackendType`.
    pub backend_type: Option<Cow<'static, str>>,
    /// OID of the connected database (`MyDatabaseId`); 0 for processes not connected to one.
    pub database_oid: Option<u32>,
    pub state: Option<&'static str>,
    /// `pg_stat_activity.query_id` / `pg_stat_statements.queryid` (signed, as SQL shows it); 0
    /// when not computed for the current statement.
    pub query_id: Option<i64>,
    /// `(wait_event_type, wait_event)`.
    pub wait_event: Option<(&'static str, Cow<'static, str>)>,
    /// On-CPU samples in a trigger of the statement: the innermost one.
    pub trigger: Option<TriggerRef>,
}

/// A trigger a backend ran, as its memory holds it: OIDs in its database.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TriggerRef {
    /// `pg_trigger.oid`.
    pub oid: u32,
    /// `pg_trigger.tgconstraint`: the constraint the trigger enforces (a foreign key's), 0 if
    /// none.
    pub constraint_oid: u32,
}

/// What only the server knows the names of, by OID, for the labels.
#[derive(Clone, Copy, Debug)]
pub struct LabelNames<'a> {
    /// `pg_database.datname`.
    pub databases: &'a HashMap<u32, String>,
    /// (database, `pg_trigger.oid`) → how the trigger label names it ([`trigger_label`]).
    pub triggers: &'a HashMap<(u32, u32), String>,
}

/// The `trigger` label of a trigger named `trigger` enforcing `constraint` (if any): a
/// constraint's trigger is named by its constraint, as EXPLAIN ANALYZE names it ("Trigger for
/// constraint …"), since its own name is generated (`RI_ConstraintTrigger_a_16410`).
pub fn trigger_label(trigger: &str, constraint: Option<&str>) -> String {
    match constraint {
        Some(constraint) => format!("constraint {constraint}"),
        None => format!("trigger {trigger}"),
    }
}

impl Attribution {
    /// Decodes the attribution fields of a sample; fields the sample could not read stay `None`.
    /// `names` supplies what only the server knows (worker types, extension tranche names).
    pub fn decode(header: &SampleHeader, table: &VersionTable, names: &mut InstanceNames) -> Self {
        let has = |flag: u32| header.attribution & flag != 0;
        let status = has(ATTR_STATUS);
        let type_name = has(ATTR_BACKEND_TYPE)
            .then(|| (table.backend_type_name)(header.backend_type))
            .flatten();
        // Only statements run queries: client backends and the parallel workers (background
        // workers) that carry their leader's queryid. Auxiliary processes have status entries
        // too, with a queryid that is always 0. Decided on the BackendType, before a worker
        // gets its bgw_type, so that every kind of worker keeps its queryid.
        let runs_queries = matches!(type_name, Some("client backend" | "background worker"));
        let is_worker = has(ATTR_BACKEND_TYPE) && header.backend_type == table.bg_worker_backend_type;
        let worker_type = is_worker.then(|| names.worker_type(table, header.tgid)).flatten();
        Self {
            backend_type: worker_type.map(Cow::Owned).or(type_name.map(Cow::Borrowed)),
            database_oid: has(ATTR_DATABASE).then_some(header.database_id),
            state: status
                .then(|| (table.backend_state_name)(header.backend_state))
                .flatten(),
            // PG14-17 keep it as uint64 and SQL shows it as bigint: same bits, signed.
            query_id: (status && runs_queries).then_some(header.query_id as i64),
            wait_event: has(ATTR_WAIT_EVENT)
                .then(|| names.wait_event(table, header.wait_event_info))
                .flatten(),
            trigger: (header.trigger_oid != 0).then_some(TriggerRef {
                oid: header.trigger_oid,
                constraint_oid: header.trigger_constraint,
            }),
        }
    }

    /// The sample labels, with the names used in every output (pprof, Pyroscope). The database
    /// is named as `pg_stat_activity.datname` when `names` has its OID, and by the OID
    /// otherwise; a trigger likewise (`trigger 16410` until named).
    pub fn push_labels(&self, labels: &mut Vec<(String, String)>, names: LabelNames<'_>) {
        if let Some(backend_type) = &self.backend_type {
            labels.push((label::BACKEND_TYPE.into(), backend_type.to_string()));
        }
        if let Some(oid) = self.database_oid.filter(|&oid| oid != 0) {
            let name = names
                .databases
                .get(&oid)
                .cloned()
                .unwrap_or_else(|| oid.to_string());
            labels.push((label::DATABASE.into(), name));
        }
        if let Some(state) = self.state {
            labels.push((label::STATE.into(), state.into()));
        }
        if let Some(query_id) = self.query_id {
            labels.push((label::QUERY_ID.into(), query_id.to_string()));
        }
        if let Some((kind, name)) = &self.wait_event {
            labels.push((label::WAIT_EVENT.into(), format!("{kind}:{name}")));
        }
        if let Some(trigger) = self.trigger {
            let database = self.database_oid.unwrap_or(0);
            let name = names
                .triggers
                .get(&(database, trigger.oid))
                .cloned()
                .unwrap_or_else(|| format!("trigger {}", trigger.oid));
            labels.push((label::TRIGGER.into(), name));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::abi::RawAttribution;
    use crate::postgres::v15::TABLE;

    fn header(attribution: u32) -> SampleHeader {
        SampleHeader::with_attribution(
            1,
            &RawAttribution {
                query_id: (-42i64) as u64,
                wait_event_info: 0x0A00_0011,
                backend_type: 3,
                database_id: 16384,
                backend_state: 2,
                flags: attribution,
                off_cpu_class: 0,
            },
        )
    }

    fn decode(header: &SampleHeader) -> Attribution {
        Attribution::decode(header, &TABLE, &mut InstanceNames::default())
    }

    fn labels(attribution: &Attribution, database_names: &HashMap<u32, String>) -> Vec<(String, String)> {
        let mut labels = Vec::new();
        let names = LabelNames {
            databases: database_names,
            triggers: &HashMap::new(),
        };
        attribution.push_labels(&mut labels, names);
        labels
    }

    fn label(key: &str, value: &str) -> (String, String) {
        (key.into(), value.into())
    }

    #[test]
    fn decodes_every_field_that_was_read() {
        let all = ATTR_BACKEND_TYPE | ATTR_DATABASE | ATTR_STATUS | ATTR_WAIT_EVENT;
        let attribution = decode(&header(all));
        assert_eq!(attribution.backend_type.as_deref(), Some("client backend"));
        assert_eq!(attribution.database_oid, Some(16384));
        assert_eq!(attribution.state, Some("active"));
        assert_eq!(attribution.query_id, Some(-42));
        assert_eq!(
            attribution.wait_event,
            Some(("IO", Cow::Borrowed("DataFileRead")))
        );
        let unnamed = labels(&attribution, &HashMap::new());
        assert!(unnamed.contains(&label("queryid", "-42")));
        assert!(unnamed.contains(&label("wait_event", "IO:DataFileRead")));
        assert!(unnamed.contains(&label("database", "16384")));
        let named = labels(&attribution, &HashMap::from([(16384, "shop".to_string())]));
        assert!(named.contains(&label("database", "shop")), "{named:?}");
    }

    #[test]
    fn auxiliary_processes_get_no_queryid() {
        let mut walwriter = header(ATTR_BACKEND_TYPE | ATTR_STATUS);
        walwriter.backend_type = 10;
        walwriter.query_id = 0;
        let attribution = decode(&walwriter);
        assert_eq!(attribution.backend_type.as_deref(), Some("walwriter"));
        assert_eq!(attribution.query_id, None);
    }

    #[test]
    fn background_workers_are_named_by_their_type_and_keep_the_queryid() {
        let mut worker = header(ATTR_BACKEND_TYPE | ATTR_STATUS);
        worker.backend_type = TABLE.bg_worker_backend_type;
        worker.tgid = std::process::id();
        // A BackgroundWorker in this process's memory, as MyBgworkerEntry points to one.
        let mut entry = vec![0u8; (TABLE.bgw_type_offset + TABLE.bgw_maxlen) as usize];
        let offset = TABLE.bgw_type_offset as usize;
        entry[offset..offset + 15].copy_from_slice(b"parallel worker");
        let entry_global = std::hint::black_box(entry.as_ptr()) as u64;
        let mut names = InstanceNames::with_worker_entry(&entry_global as *const u64 as u64);
        let attribution = Attribution::decode(&worker, &TABLE, &mut names);
        assert_eq!(attribution.backend_type.as_deref(), Some("parallel worker"));
        assert_eq!(attribution.query_id, Some(-42));
        // Its type unknown, it is what its BackendType says, still with the queryid.
        let attribution = decode(&worker);
        assert_eq!(attribution.backend_type.as_deref(), Some("background worker"));
        assert_eq!(attribution.query_id, Some(-42));
    }

    #[test]
    fn fields_not_read_are_absent() {
        let attribution = decode(&header(ATTR_BACKEND_TYPE));
        assert_eq!(attribution.backend_type.as_deref(), Some("client backend"));
        assert_eq!(attribution.query_id, None);
        assert_eq!(attribution.state, None);
        assert_eq!(attribution.wait_event, None);
        assert_eq!(attribution.database_oid, None);
    }
}
