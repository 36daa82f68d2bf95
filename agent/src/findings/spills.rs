//! Operators that outgrow `work_mem`: a statement whose time goes to a sort, a hash aggregate or
//! a hash join, and whose pg_stat_statements counters show it wrote temporary files over the
//! trace. Neither alone names the cause: a sort in memory costs CPU too, and a statement can
//! write temporary files for a materialization that costs nothing. Together they do, whatever
//! the query: the operator is where its time goes, and the temporary blocks say it did not fit.

use super::counted::{per_statement, Deltas};
use super::cpu::supported_share;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::wall_clock::waited_in;
use crate::model::{StatementCpu, StatementWall};
use crate::postgres::sql::InstanceFacts;
use crate::postgres::subsystems::{self, Subsystem};

/// The operators that spill to temporary files when work_mem is too small for them.
const OPERATORS: [&Subsystem; 3] = [
    &subsystems::SORT,
    &subsystems::HASH_AGGREGATE,
    &subsystems::HASH_JOIN,
];
/// The operator's share of the statement's CPU from which its spilling is worth acting on:
/// a quarter, the share where fitting it in memory changes the statement's time by more than
/// its usual variation. Half of it is a critical share.
const SPILL_WARN: f64 = 0.25;
const SPILL_CRITICAL: f64 = 0.50;
/// The share the samples must support with 95% confidence (a few dozen samples reading a
/// quarter may hold a tenth).
const SPILL_SUPPORTED: f64 = 0.15;
/// Postgres' block size, in which pg_stat_statements counts temporary blocks (8 kB in every
/// build a distribution ships).
const BLOCK_BYTES: f64 = 8192.0;
/// The waits of a backend reading and writing its temporary files.
const TEMP_FILE_WAITS: [&str; 2] = ["IO:BufFileRead", "IO:BufFileWrite"];

/// The statements of `queries` whose sort or hash holds [`SPILL_WARN`] of their CPU and whose
/// pg_stat_statements counters (`facts`) grew in `temp_blks_written` over the trace; their
/// cost is the operator's CPU and their waits on temporary files (`walls`).
pub fn spilling_operators(
    queries: &[StatementCpu],
    facts: Option<&InstanceFacts>,
    walls: &[StatementWall],
    period_ns: u64,
) -> Vec<Finding> {
    per_statement(queries, facts, |q, counters| {
        spill_of(q, counters, walls, period_ns)
    })
}

/// The finding for statement `q`, given its counters' growth over the trace.
fn spill_of(
    q: &StatementCpu,
    counters: Deltas<'_>,
    walls: &[StatementWall],
    period_ns: u64,
) -> Option<Finding> {
    let get = |name: &str| counters.get(name);
    let (calls, written) = (get("calls"), get("temp_blks_written"));
    if calls < 1.0 || written <= 0.0 {
        return None;
    }
    let (operator, samples) = OPERATORS
        .iter()
        .map(|op| (*op, q.in_subsystem(op)))
        .max_by_key(|(_, samples)| *samples)?;
    let share = samples as f64 / q.samples as f64;
    if share < SPILL_WARN || supported_share(samples, q.samples) < SPILL_SUPPORTED {
        return None;
    }
    let waited = waited_in(walls, q.query_id, &TEMP_FILE_WAITS);
    let per_call = mib(written * BLOCK_BYTES / calls);
    let (doing, knob) = match operator.name {
        "sort" => ("sorting", "work_mem"),
        "hash_aggregate" => ("grouping in a hash table", "work_mem × hash_mem_multiplier"),
        _ => (
            "building and probing a hash join",
            "work_mem × hash_mem_multiplier",
        ),
    };
    let mut numbers = vec![
        (format!("CPU under {}", operator.what), percent(share)),
        (
            "temporary blocks written per call (pg_stat_statements)".into(),
            format!("{:.0} ({per_call})", written / calls),
        ),
        (
            "temporary blocks written over the trace".into(),
            format!(
                "{written:.0} in {calls:.0} calls ({})",
                mib(written * BLOCK_BYTES)
            ),
        ),
    ];
    let temp_cpu = q.in_subsystem(&subsystems::TEMP_FILES);
    if temp_cpu > 0 {
        numbers.push((
            "CPU reading and writing temporary files".into(),
            percent(temp_cpu as f64 / q.samples as f64),
        ));
    }
    if waited > 0 {
        numbers.push((
            "waiting on temporary files (IO:BufFileRead, IO:BufFileWrite)".into(),
            format!("{:.1} ms", waited as f64 / 1e6),
        ));
    }
    numbers.push(("samples".into(), q.samples.to_string()));
    Some(Finding {
        kind: "operator_spill",
        severity: Severity::warning_or_critical(share, SPILL_CRITICAL),
        title: format!(
            "queryid {} spends {} of its CPU {doing}, and spills to temporary files: {per_call} \
             written per call, more than {knob} holds",
            q.query_id,
            percent(share)
        ),
        numbers,
        query_ids: vec![q.query_id],
        frames: cited(q, operator),
        action: format!(
            "give this statement more memory than it writes to disk, with margin (rows take more \
             room in memory than in temporary files): SET LOCAL {} for its transaction, or for \
             its role; or make it need less (an index that returns rows in the order wanted, \
             fewer rows or columns before the {}); EXPLAIN (ANALYZE, BUFFERS) shows the node \
             and what it wrote, log_temp_files each file",
            if knob == "work_mem" {
                "work_mem"
            } else {
                "work_mem (or hash_mem_multiplier)"
            },
            if operator.name == "sort" { "sort" } else { "hash" }
        ),
        cause: Some(StatementCause {
            cause: format!("spend their CPU {doing} and spill to temporary files"),
            figures: vec![format!("{} of its CPU, {per_call} per call", percent(share))],
            cost_ns: samples * period_ns + waited,
        }),
    })
}

/// The frames of `q`'s hottest path that belong to `operator`, else the operator's first
/// function: a finding cites frames sampled under the statement.
fn cited(q: &StatementCpu, operator: &Subsystem) -> Vec<String> {
    let sampled: Vec<String> = q
        .hot_paths
        .iter()
        .flat_map(|path| &path.steps)
        .filter(|step| operator.holds(&step.frame.name, step.frame.module.as_deref()))
        .map(|step| step.frame.name.to_string())
        .fold(Vec::new(), |mut names, name| {
            if !names.contains(&name) {
                names.push(name);
            }
            names
        });
    sampled.into_iter().take(4).collect()
}

/// `bytes` in MiB (or KiB under one), as a DBA reads a temporary file's size.
fn mib(bytes: f64) -> String {
    if bytes < 1024.0 * 1024.0 {
        format!("{:.0} KiB", bytes / 1024.0)
    } else {
        format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::findings::counted::facts_of_statement_7;
    use crate::model::wall_clock::WallPart;
    use crate::model::QueryId;

    const PERIOD_NS: u64 = 10_101_010;

    fn statement(sort: u64, hash_join: u64) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(7),
            samples: 200,
            subsystems: BTreeMap::from([("sort", sort), ("hash_join", hash_join), ("temp_files", 12)]),
            ..StatementCpu::default()
        }
    }

    fn facts(temp_blks_written: f64) -> InstanceFacts {
        facts_of_statement_7(&[("calls", 4.0), ("temp_blks_written", temp_blks_written)])
    }

    fn walls() -> Vec<StatementWall> {
        vec![StatementWall {
            query_id: QueryId(7),
            total_ns: 3_000_000_000,
            parts: vec![
                WallPart {
                    name: "CPU".into(),
                    ns: 2_000_000_000,
                },
                WallPart {
                    name: "IO:BufFileWrite".into(),
                    ns: 300_000_000,
                },
                WallPart {
                    name: "IO:DataFileRead".into(),
                    ns: 700_000_000,
                },
            ],
        }]
    }

    #[test]
    fn a_sort_that_wrote_temporary_files_is_named_with_its_size_and_cost() {
        let found = spilling_operators(&[statement(130, 20)], Some(&facts(12800.0)), &walls(), PERIOD_NS);
        assert_eq!(found.len(), 1, "{found:?}");
        let finding = &found[0];
        assert_eq!(finding.kind, "operator_spill");
        assert_eq!(finding.severity, Severity::Critical);
        assert!(
            finding.title.contains("65.0% of its CPU sorting"),
            "{}",
            finding.title
        );
        assert!(
            finding.title.contains("25.0 MiB written per call"),
            "{}",
            finding.title
        );
        // Its cost: the sort's CPU and the waits on temporary files, not the other reads.
        let cause = finding.cause.as_ref().map(|c| c.cost_ns);
        assert_eq!(cause, Some(130 * PERIOD_NS + 300_000_000));
        assert!(
            finding.action.contains("SET LOCAL work_mem"),
            "{}",
            finding.action
        );
        // Advice never lowers the memory the evidence shows too small.
        assert!(!finding.action.contains("lower"));
    }

    #[test]
    fn the_larger_operator_is_named_and_hashes_point_at_hash_mem_multiplier() {
        let found = spilling_operators(&[statement(10, 70)], Some(&facts(64.0)), &[], PERIOD_NS);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].severity, Severity::Warning);
        assert!(found[0].title.contains("hash join"), "{}", found[0].title);
        assert!(
            found[0].title.contains("128 KiB written per call"),
            "{}",
            found[0].title
        );
        assert!(found[0].action.contains("hash_mem_multiplier"));
    }

    #[test]
    fn without_temporary_files_or_without_the_time_there_is_no_spill() {
        // Sorting in memory: the counters rule a spill out, however long it sorts.
        assert!(spilling_operators(&[statement(190, 0)], Some(&facts(0.0)), &[], PERIOD_NS).is_empty());
        // Temporary files, but the sort is a small part of the statement.
        assert!(spilling_operators(&[statement(30, 0)], Some(&facts(12800.0)), &[], PERIOD_NS).is_empty());
        // No counters read: nothing to confirm with.
        assert!(spilling_operators(&[statement(190, 0)], None, &[], PERIOD_NS).is_empty());
        // Too few samples to say anything.
        let few = StatementCpu {
            samples: 10,
            ..statement(8, 0)
        };
        assert!(spilling_operators(&[few], Some(&facts(12800.0)), &[], PERIOD_NS).is_empty());
    }
}
