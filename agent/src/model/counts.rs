//! What pgscope counted besides samples: function-probe calls and time per queryid, spinlock
//! call sites that spun, and pg_stat_statements' eviction counter. Filled by the front ends
//! from the probes and SQL; read by the rules and the views, and kept in recordings.

use serde::{Deserialize, Serialize};

use super::QueryId;
use crate::bpf::abi::Function;

/// One probed function's calls for one queryid (estimated when duty-cycled).
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeRow {
    pub query_id: QueryId,
    pub function: Function,
    pub calls: u64,
    /// The function's own time: entry to return, less the calibrated cost of the probe traps
    /// of the probed calls it made (`collect::probes::nested`).
    pub total_ns: u64,
    /// pgss_store: its `pgssStoreKind` + 2 ([`PGSS_TEXT_ONLY`], plan 2, exec 3); 0 for other
    /// functions, or not known (a recording of an older pgscope).
    pub detail: u32,
}

/// `ProbeRow::detail` of a pgss_store call that only stores the statement's text (a new
/// statement's first sight, after parse analysis): it takes no entry's spinlock.
pub const PGSS_TEXT_ONLY: u32 = 1;

impl ProbeRow {
    /// A pgss_store call that updates the statement's entry (its counters, under the
    /// entry's spinlock): the plan and exec stores, not the text-only one.
    pub fn updates_pgss_entry(&self) -> bool {
        self.function == Function::PgssStore && self.detail != PGSS_TEXT_ONLY
    }
}

/// One call site's spins for one queryid (`--probes s_lock`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpinSiteRow {
    pub query_id: QueryId,
    /// `__FILE__`, `__LINE__` and `__func__` of the acquisition.
    pub file: String,
    pub line: u32,
    pub function: String,
    /// Acquisitions that had to spin, and the time until they got the lock.
    pub calls: u64,
    pub total_ns: u64,
}

/// pg_stat_statements' eviction counter over the measurement.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PgssEvidence {
    /// `pg_stat_statements_info.dealloc` at the end less at the start.
    pub evictions: i64,
    /// `pg_stat_statements.max`.
    pub max: i64,
    pub seconds: f64,
}
