//! The report's per-queryid rows: on-CPU phases, off-CPU time and probe counts of each query,
//! joined by queryid.

use std::collections::BTreeMap;

use super::recording::Recording;
use crate::model::{Analysis, ProbeRow, QueryId, StatementCpu};

/// Rows the table shows at most: the busiest queries; the rest are in the flamegraphs.
const MAX_ROWS: usize = 100;

pub struct QueryRow {
    pub query_id: QueryId,
    pub text: Option<String>,
    /// Its on-CPU samples, when it had any.
    pub cpu: Option<StatementCpu>,
    /// Off-CPU nanoseconds (idle client waits left out).
    pub off_cpu_ns: u64,
    /// Its longest wait: `LWLock:pg_stat_statements (futex) 12.3 ms`.
    pub longest_wait: Option<String>,
    /// Where its wall-clock time went: `CPU 38% · LWLock:pg_stat_statements 41% · …`.
    pub time_split: Option<String>,
    /// Its function-probe counts, most calls first.
    pub probes: Vec<ProbeRow>,
}

/// Every query seen on CPU, off CPU or by a probe, busiest on CPU first, then longest off CPU.
pub fn query_rows(recording: &Recording, analysis: &Analysis) -> Vec<QueryRow> {
    let mut rows: BTreeMap<QueryId, QueryRow> = BTreeMap::new();
    for statement in &analysis.statements {
        row(&mut rows, recording, statement.query_id).cpu = Some(statement.clone());
    }
    let waiting = analysis.waits.iter().flat_map(|waits| &waits.by_query);
    for query in waiting.filter(|query| query.query_id.is_statement()) {
        // Idle client waits are the client's think time, left out as in the off-CPU flamegraph.
        let mut not_idle = query.not_idle().peekable();
        let Some(longest) = not_idle.peek() else {
            continue;
        };
        let longest_wait = format!(
            "{} ({}) {:.1} ms",
            longest.wait,
            longest.class,
            longest.ns as f64 / 1e6
        );
        let entry = row(&mut rows, recording, query.query_id);
        entry.longest_wait = Some(longest_wait);
        entry.off_cpu_ns = not_idle.map(|w| w.ns).sum();
    }
    for wall in &analysis.walls {
        row(&mut rows, recording, wall.query_id).time_split = Some(wall.render());
    }
    for probe in analysis.measured.probes {
        row(&mut rows, recording, probe.query_id)
            .probes
            .push(probe.clone());
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
fn row<'a>(
    rows: &'a mut BTreeMap<QueryId, QueryRow>,
    recording: &Recording,
    query_id: QueryId,
) -> &'a mut QueryRow {
    rows.entry(query_id).or_insert_with(|| QueryRow {
        query_id,
        text: recording.query_text(query_id).map(str::to_string),
        cpu: None,
        off_cpu_ns: 0,
        longest_wait: None,
        time_split: None,
        probes: Vec::new(),
    })
}
