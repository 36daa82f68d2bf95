//! `pg_stat_activity` as the attribution tests compare sample labels with it: rows, the labels
//! pgscope should put on a process's samples, and reading rows while a trace runs.

use std::collections::{BTreeMap, BTreeSet};
use std::thread;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use crate::{LabeledProfile, LabeledSample, PgCluster, Trace};

/// `pg_stat_activity.backend_type` of client connections.
pub const CLIENT_BACKEND: &str = "client backend";

/// Label name → value a sample should carry (`None`: no such label).
pub type Labels = BTreeMap<&'static str, Option<String>>;

/// One `pg_stat_activity` row, the columns the labels mirror. Empty columns are NULL.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Activity {
    pub pid: u32,
    pub backend_type: String,
    pub datname: Option<String>,
    pub state: Option<String>,
    pub query_id: Option<String>,
    pub wait_event: Option<String>,
}

/// `backend_type` values of the processes core Postgres 15 starts (`GetBackendTypeDesc`); any
/// other is a background worker's `bgw_type`.
pub const CORE_BACKEND_TYPES: &[&str] = &[
    "autovacuum launcher",
    "autovacuum worker",
    "archiver",
    "background writer",
    "checkpointer",
    "client backend",
    "logger",
    "standalone backend",
    "startup",
    "walreceiver",
    "walsender",
    "walwriter",
];

impl Activity {
    /// The rows of `pg_stat_activity` that satisfy `condition` (SQL).
    pub fn read(cluster: &PgCluster, condition: &str) -> Result<Vec<Activity>> {
        let out = cluster.psql(&format!(
            "SELECT pid, backend_type, coalesce(datname::text, ''), coalesce(state, ''), \
             coalesce(query_id::text, ''), coalesce(wait_event_type || ':' || wait_event, '') \
             FROM pg_stat_activity WHERE {condition} ORDER BY pid"
        ))?;
        out.lines()
            .map(|line| {
                let fields: Vec<&str> = line.split('|').collect();
                ensure!(fields.len() == 6, "unexpected pg_stat_activity row `{line}`");
                let column = |i: usize| (!fields[i].is_empty()).then(|| fields[i].to_owned());
                Ok(Activity {
                    pid: fields[0]
                        .parse()
                        .with_context(|| format!("bad pid in `{line}`"))?,
                    backend_type: fields[1].to_owned(),
                    datname: column(2),
                    state: column(3),
                    query_id: column(4),
                    wait_event: column(5),
                })
            })
            .collect()
    }

    /// The labels pgscope should put on this process's samples (wait event aside, which changes
    /// too fast to compare with a read at another moment): the same backend type (a worker's
    /// `bgw_type`), database name, state and queryid.
    pub fn expected_labels(&self) -> Labels {
        let is_worker = !CORE_BACKEND_TYPES.contains(&self.backend_type.as_str());
        // pg_stat_activity shows a queryid of 0 as NULL.
        let runs_queries = is_worker || self.backend_type == CLIENT_BACKEND;
        let query_id = runs_queries.then(|| self.query_id.clone().unwrap_or_else(|| "0".into()));
        BTreeMap::from([
            ("backend_type", Some(self.backend_type.clone())),
            ("database", self.datname.clone()),
            ("state", self.state.clone()),
            ("queryid", query_id),
        ])
    }
}

/// Whether `sample` carries exactly `expected` (a `None` value: no such label).
pub fn has_labels(sample: &LabeledSample, expected: &Labels) -> bool {
    expected
        .iter()
        .all(|(key, value)| sample.label(key) == value.as_deref())
}

/// `label=value` pairs of the most frequent label sets among `pid`'s samples.
pub fn label_sets(profile: &LabeledProfile, pid: u32, keys: &[&str]) -> String {
    let mut sets: BTreeMap<String, u64> = BTreeMap::new();
    for s in profile.samples.iter().filter(|s| s.pid() == Some(pid)) {
        let set: Vec<String> = keys
            .iter()
            .map(|k| format!("{k}={}", s.label(k).unwrap_or("-")))
            .collect();
        *sets.entry(set.join(" ")).or_insert(0) += s.count;
    }
    let mut sets: Vec<(String, u64)> = sets.into_iter().collect();
    sets.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    sets.iter()
        .take(4)
        .map(|(set, n)| format!("{n}× {set}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Runs `trace` while reading the `pg_stat_activity` rows that satisfy `condition` over and
/// over; returns every distinct row seen.
pub fn trace_reading_activity(
    cluster: &PgCluster,
    trace: &Trace,
    condition: &str,
) -> Result<BTreeSet<Activity>> {
    thread::scope(|scope| {
        let tracing = scope.spawn(|| trace.run());
        let mut seen = BTreeSet::new();
        while !tracing.is_finished() {
            seen.extend(Activity::read(cluster, condition)?);
            thread::sleep(Duration::from_millis(100));
        }
        tracing.join().expect("the trace thread panicked")?;
        Ok(seen)
    })
}
