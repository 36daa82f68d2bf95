//! Settings as the sampled backends ran them, by statement: a setting given per role or
//! database (`ALTER ROLE … SET`), by `PGOPTIONS` or by `SET` is what a backend uses, and
//! pgscope's own session, which `current_setting` answers for, would not see it. Each backend's
//! value is read from its memory at its first sample with a queryid (one 4-byte read), while it
//! is alive: backends of a short workload are gone by the end of the trace.

use std::collections::{BTreeMap, HashMap};

use crate::postgres::backend_settings;
use crate::postgres::VersionTable;

/// `plan_cache_mode` per statement, as the backends running it had it.
#[derive(Debug, Default)]
pub struct SettingsSeen {
    /// The variable's address per instance root (None: not exported or not readable).
    address: HashMap<u32, Option<u64>>,
    /// Each live backend's value, read once.
    by_pid: HashMap<u32, Option<&'static str>>,
    /// Samples per (queryid, plan_cache_mode).
    by_query: BTreeMap<i64, BTreeMap<&'static str, u64>>,
}

impl SettingsSeen {
    /// A sample of statement `query_id` taken in backend `pid` of the instance of `root`.
    pub fn record(&mut self, root: u32, pid: u32, query_id: i64, table: &VersionTable) {
        let address = *self
            .address
            .entry(root)
            .or_insert_with(|| backend_settings::plan_cache_mode_address(root));
        let Some(address) = address else {
            return;
        };
        let mode = *self
            .by_pid
            .entry(pid)
            .or_insert_with(|| backend_settings::plan_cache_mode_at(pid, address, table).ok());
        if let Some(mode) = mode {
            *self
                .by_query
                .entry(query_id)
                .or_default()
                .entry(mode)
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
}
