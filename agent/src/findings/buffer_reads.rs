//! Statements whose time goes to reading pages that shared buffers did not hold: their working
//! set does not fit `shared_buffers`. Named where a statement's time reading data files (on CPU
//! under the storage manager's reads, and waiting on `IO:DataFileRead`) is a large part of it
//! and its pg_stat_statements counters show a large share of the blocks it touched were read
//! rather than found. Time in the buffer manager on hits alone is not this cause, nor are a
//! few reads at a statement's first executions.

use super::counted::{per_statement, Deltas};
use super::cpu::supported_share;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::wall_clock::{total_of, waited_in};
use crate::model::{StatementCpu, StatementWall};
use crate::postgres::sql::InstanceFacts;
use crate::postgres::subsystems::DATA_FILE_READS;

/// The share of a statement's time (its CPU where off-CPU time is not measured) spent reading
/// pages in from which it is worth acting on; half of it is a critical share.
const READS_WARN: f64 = 0.25;
const READS_CRITICAL: f64 = 0.50;
/// The share the reads' CPU samples must support with 95% confidence, without off-CPU time.
const READS_SUPPORTED: f64 = 0.15;
/// The share of its blocks a statement read in rather than found: a hit ratio under 90%, the
/// figure DBAs watch, is a working set that does not fit.
const MISS_SHARE: f64 = 0.10;
/// The waits of a backend reading a data file.
const READ_WAITS: [&str; 2] = ["IO:DataFileRead", "IO:DataFilePrefetch"];

/// The statements of `queries` spending [`READS_WARN`] of their time reading pages in, with
/// [`MISS_SHARE`] of their blocks read over the trace (`facts`' pg_stat_statements deltas).
pub fn shared_buffer_misses(
    queries: &[StatementCpu],
    facts: Option<&InstanceFacts>,
    walls: &[StatementWall],
    period_ns: u64,
) -> Vec<Finding> {
    per_statement(queries, facts, |q, counters| {
        misses(q, counters, walls, period_ns)
    })
}

/// The finding for statement `q`, given its counters' growth over the trace.
fn misses(
    q: &StatementCpu,
    counters: Deltas<'_>,
    walls: &[StatementWall],
    period_ns: u64,
) -> Option<Finding> {
    let get = |name: &str| counters.get(name);
    let (calls, read, hit) = (get("calls"), get("shared_blks_read"), get("shared_blks_hit"));
    if calls < 1.0 || read <= 0.0 || read / (read + hit) < MISS_SHARE {
        return None;
    }
    let samples = q.in_subsystem(&DATA_FILE_READS);
    let cpu_ns = samples * period_ns;
    let waited = waited_in(walls, q.query_id, &READ_WAITS);
    let wall = total_of(walls, q.query_id);
    // Without off-CPU time, its CPU samples alone, which must support the share.
    let share = match wall {
        Some(total) => (cpu_ns + waited) as f64 / total as f64,
        None if supported_share(samples, q.samples) >= READS_SUPPORTED => samples as f64 / q.samples as f64,
        None => 0.0,
    };
    if share < READS_WARN {
        return None;
    }
    let of = if wall.is_some() { "time" } else { "CPU" };
    let miss = read / (read + hit);
    let mut numbers = vec![
        (format!("reading pages in, of its {of}"), percent(share)),
        (
            "blocks read into shared buffers per call (pg_stat_statements)".into(),
            format!("{:.0} ({} of the blocks it touched)", read / calls, percent(miss)),
        ),
        (
            "blocks found in shared buffers per call".into(),
            format!("{:.0}", hit / calls),
        ),
        (
            format!("CPU under {}", DATA_FILE_READS.what),
            percent(samples as f64 / q.samples as f64),
        ),
    ];
    if waited > 0 {
        numbers.push((
            "waiting on IO:DataFileRead".into(),
            format!("{:.1} ms", waited as f64 / 1e6),
        ));
    }
    numbers.push(("samples".into(), q.samples.to_string()));
    Some(Finding {
        kind: "shared_buffer_misses",
        severity: Severity::warning_or_critical(share, READS_CRITICAL),
        title: format!(
            "queryid {} spends {} of its {of} reading pages shared buffers did not hold: {} of \
             the blocks it touched were read in ({:.0} per call)",
            q.query_id,
            percent(share),
            percent(miss),
            read / calls
        ),
        numbers,
        query_ids: vec![q.query_id],
        frames: vec![
            "ReadBuffer_common".into(),
            "WaitReadBuffers".into(),
            "mdread".into(),
            "FileRead".into(),
        ],
        action: "its working set does not fit shared_buffers: compare shared_buffers with the \
                 tables and indexes it reads (pg_buffercache shows what is cached, \
                 pg_relation_size what they need), or make it read fewer pages (an index \
                 that selects fewer rows, a covering index for an index-only scan, rows it \
                 looks up together stored together)"
            .into(),
        cause: Some(StatementCause {
            cause: "read the pages they need from outside shared buffers".into(),
            figures: vec![format!(
                "{} of its {of}, {} of its blocks read",
                percent(share),
                percent(miss)
            )],
            cost_ns: cpu_ns + waited,
        }),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::findings::counted::facts_of_statement_7;
    use crate::model::wall_clock::{WallPart, CPU};
    use crate::model::QueryId;

    const PERIOD_NS: u64 = 10_000_000;

    fn statement(reading: u64) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(7),
            samples: 200,
            subsystems: BTreeMap::from([("data_file_reads", reading), ("buffer_manager", 150)]),
            ..StatementCpu::default()
        }
    }

    fn facts(read: f64, hit: f64) -> InstanceFacts {
        facts_of_statement_7(&[
            ("calls", 10.0),
            ("shared_blks_read", read),
            ("shared_blks_hit", hit),
        ])
    }

    #[test]
    fn a_statement_reading_most_of_its_pages_in_is_named_with_its_hit_ratio() {
        let found = shared_buffer_misses(&[statement(90)], Some(&facts(12_000.0, 8_000.0)), &[], PERIOD_NS);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].severity, Severity::Warning);
        assert!(
            found[0].title.contains("45.0% of its CPU reading pages shared buffers did not hold: 60.0% of the blocks it touched were read in (1200 per call)"),
            "{}",
            found[0].title
        );
        // Its waits on reads count in its time and cost.
        let walls = [StatementWall {
            query_id: QueryId(7),
            total_ns: 4_000_000_000,
            parts: vec![
                WallPart {
                    name: CPU.into(),
                    ns: 2_000_000_000,
                },
                WallPart {
                    name: "IO:DataFileRead".into(),
                    ns: 1_500_000_000,
                },
                WallPart {
                    name: "Lock:transactionid".into(),
                    ns: 500_000_000,
                },
            ],
        }];
        let found = shared_buffer_misses(
            &[statement(90)],
            Some(&facts(12_000.0, 8_000.0)),
            &walls,
            PERIOD_NS,
        );
        assert_eq!(found[0].severity, Severity::Critical);
        assert_eq!(
            found[0].cause.as_ref().map(|c| c.cost_ns),
            Some(900_000_000 + 1_500_000_000)
        );
        assert!(!found[0].action.contains("lower"));
    }

    #[test]
    fn hits_or_a_few_reads_are_not_this_cause() {
        // The buffer manager's time on hits: nothing read.
        assert!(
            shared_buffer_misses(&[statement(90)], Some(&facts(0.0, 20_000.0)), &[], PERIOD_NS).is_empty()
        );
        // A hit ratio above 90%: the working set fits.
        assert!(
            shared_buffer_misses(&[statement(90)], Some(&facts(500.0, 19_500.0)), &[], PERIOD_NS).is_empty()
        );
        // Reading is a small part of its time.
        assert!(
            shared_buffer_misses(&[statement(20)], Some(&facts(12_000.0, 8_000.0)), &[], PERIOD_NS)
                .is_empty()
        );
        assert!(shared_buffer_misses(&[statement(90)], None, &[], PERIOD_NS).is_empty());
    }
}
