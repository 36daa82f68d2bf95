//! The report's per-queryid rows: on-CPU phases, off-CPU time and probe counts of each query,
//! joined by queryid.

use std::collections::BTreeMap;

use exporters::Profile;

use super::recording::Recording;
use crate::findings::ProbeRow;
use crate::trace::queries::{summarize, QuerySummary};

/// Rows the table shows at most: the busiest queries; the rest are in the flamegraphs.
const MAX_ROWS: usize = 100;

pub struct QueryRow {
    pub query_id: i64,
    pub text: Option<String>,
    /// Its on-CPU samples, when it had any.
    pub cpu: Option<QuerySummary>,
    /// Off-CPU nanoseconds (idle client waits left out).
    pub off_cpu_ns: u64,
    /// Its longest wait: `LWLock:pg_stat_statements (futex) 12.3 ms`.
    pub longest_wait: Option<String>,
    /// Its function-probe counts, most calls first.
    pub probes: Vec<ProbeRow>,
}

/// Every query seen on CPU, off CPU or by a probe, busiest on CPU first, then longest off CPU.
pub fn query_rows(recording: &Recording, off_cpu: Option<&Profile>) -> Vec<QueryRow> {
    let mut rows: BTreeMap<i64, QueryRow> = BTreeMap::new();
    for summary in summarize(&recording.on_cpu) {
        let query_id = summary.query_id;
        row(&mut rows, recording, query_id).cpu = Some(summary);
    }
    if let Some(profile) = off_cpu {
        for (query_id, waits) in crate::trace::off_cpu::by_query(profile) {
            let entry = row(&mut rows, recording, query_id);
            entry.off_cpu_ns = waits.iter().map(|w| w.ns).sum();
            entry.longest_wait = waits
                .first()
                .map(|w| format!("{} ({}) {:.1} ms", w.wait, w.class, w.ns as f64 / 1e6));
        }
    }
    for probe in recording.probe_rows() {
        row(&mut rows, recording, probe.query_id).probes.push(probe);
    }
    let mut rows: Vec<QueryRow> = rows.into_values().collect();
    for row in &mut rows {
        row.probes.sort_by_key(|p| std::cmp::Reverse(p.calls));
    }
    rows.sort_by_key(|row| {
        (
            std::cmp::Reverse(row.cpu.as_ref().map_or(0, |q| q.samples)),
            std::cmp::Reverse(row.off_cpu_ns),
            row.query_id,
        )
    });
    rows.truncate(MAX_ROWS);
    rows
}

/// The row of `query_id`, made empty the first time.
fn row<'a>(rows: &'a mut BTreeMap<i64, QueryRow>, recording: &Recording, query_id: i64) -> &'a mut QueryRow {
    rows.entry(query_id).or_insert_with(|| QueryRow {
        query_id,
        text: recording.query_text(query_id).map(str::to_string),
        cpu: None,
        off_cpu_ns: 0,
        longest_wait: None,
        probes: Vec::new(),
    })
}
