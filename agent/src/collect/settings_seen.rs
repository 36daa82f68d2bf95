//! Settings as the sampled backends ran them, by statement: a setting given per role or
//! database (`ALTER ROLE … SET`), by `PGOPTIONS` or by `SET` is what a backend uses, and
//! pgscope's own session, which `current_setting` answers for, would not see it. Each backend's
//! values are read from its memory at its first sample with a queryid (a few 4-byte reads),
//! while it is alive: backends of a short workload are gone by the end of the trace. A setting
//! whose variable is not exported (`pg_stat_statements.track_planning`, static in its library)
//! is resolved later from the catalog for the (database, role) the backend ran as, which is
//! kept here too.

use std::collections::{BTreeMap, HashMap};

use crate::postgres::backend_settings::{self, BackendGlobals};
use crate::postgres::sql::SessionSamples;
use crate::postgres::VersionTable;

/// What one backend was read to run with.
#[derive(Clone, Copy, Debug, Default)]
struct Backend {
    plan_cache_mode: Option<&'static str>,
    jit: Option<bool>,
    /// (database OID, role OID).
    session: Option<(u32, u32)>,
}

/// Settings and sessions per statement, as the backends running it had them.
#[derive(Debug, Default)]
pub struct SettingsSeen {
    /// The globals' addresses per instance root.
    globals: HashMap<u32, BackendGlobals>,
    /// Each live backend's values, read once.
    by_pid: HashMap<u32, Backend>,
    /// Samples per (queryid, plan_cache_mode).
    by_query: BTreeMap<i64, BTreeMap<&'static str, u64>>,
    /// Samples per (queryid, jit).
    jit_by_query: BTreeMap<i64, BTreeMap<bool, u64>>,
    /// Samples per (queryid, (database OID, role OID)).
    sessions_by_query: BTreeMap<i64, BTreeMap<(u32, u32), u64>>,
}

impl SettingsSeen {
    /// A sample of statement `query_id` taken in backend `pid` of the instance of `root`.
    pub fn record(&mut self, root: u32, pid: u32, query_id: i64, table: &VersionTable) {
        let globals = *self
            .globals
            .entry(root)
            .or_insert_with(|| BackendGlobals::locate(root, table));
        let backend = *self.by_pid.entry(pid).or_insert_with(|| Backend {
            plan_cache_mode: globals
                .plan_cache_mode
                .and_then(|at| backend_settings::plan_cache_mode_at(pid, at, table).ok()),
            jit: globals.jit.and_then(|at| backend_settings::jit_at(pid, at).ok()),
            session: backend_settings::session_at(pid, &globals, table)
                .map_err(|error| tracing::trace!(pid, "no session read: {error:#}"))
                .ok(),
        });
        if let Some(mode) = backend.plan_cache_mode {
            *self
                .by_query
                .entry(query_id)
                .or_default()
                .entry(mode)
                .or_default() += 1;
        }
        if let Some(jit) = backend.jit {
            *self
                .jit_by_query
                .entry(query_id)
                .or_default()
                .entry(jit)
                .or_default() += 1;
        }
        if let Some(session) = backend.session {
            *self
                .sessions_by_query
                .entry(query_id)
                .or_default()
                .entry(session)
                .or_default() += 1;
        }
    }

    /// Drops what was read of an exited backend: its PID may be reused.
    pub fn forget(&mut self, pid: u32) {
        self.by_pid.remove(&pid);
    }

    /// Samples per `plan_cache_mode` of each statement, by queryid.
    pub fn plan_cache_modes(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.by_query
            .iter()
            .map(|(query_id, modes)| {
                let modes = modes.iter().map(|(m, n)| (m.to_string(), *n)).collect();
                (query_id.to_string(), modes)
            })
            .collect()
    }

    /// Samples per `jit` value (`on`/`off`) of each statement, by queryid.
    pub fn jit(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.jit_by_query
            .iter()
            .map(|(query_id, values)| {
                let values = values
                    .iter()
                    .map(|(on, n)| (if *on { "on" } else { "off" }.to_string(), *n))
                    .collect();
                (query_id.to_string(), values)
            })
            .collect()
    }

    /// The (database, role) pairs each statement's backends ran as, with their samples, by
    /// queryid.
    pub fn sessions(&self) -> BTreeMap<String, Vec<SessionSamples>> {
        self.sessions_by_query
            .iter()
            .map(|(query_id, sessions)| {
                let sessions = sessions
                    .iter()
                    .map(|(&(database, role), &samples)| SessionSamples {
                        database,
                        role,
                        samples,
                    })
                    .collect();
                (query_id.to_string(), sessions)
            })
            .collect()
    }
}
