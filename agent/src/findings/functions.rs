//! Probed functions that take most of a statement's time. A probe measures each call from
//! entry to return (what it calls and any time it blocks included); the statement's time is
//! its on-CPU time (samples × period) plus its off-CPU time without idle client waits. When
//! one function takes most of it, that function is the statement's cost, whatever the plan
//! says — and each probed function is one whose cost has a known mechanism.
//!
//! Without off-CPU time the two do not compare: the statement's time is then its CPU time
//! alone, while a call's time still includes being preempted, and on a busy host a function
//! would look like most of a statement it is a small part of. Its share is then read from the
//! samples instead: of the statement's on-CPU samples, those with the function on the stack.

use std::collections::BTreeMap;

use exporters::Profile;

use super::{percent, Finding, Severity, StatementCause};
use crate::bpf::abi::Function;
use crate::model::statements::share_with_frame;
use crate::model::{ProbeRow, QueryId, StatementTime};

/// A function this share of a statement's time dominates it.
const DOMINANT: f64 = 0.50;
const CRITICAL: f64 = 0.80;
/// Calls needed before a per-call figure means anything.
const MIN_CALLS: u64 = 10;

/// What a probed function's time is, and what to consider when it dominates a statement.
fn mechanism(function: Function) -> Option<(&'static str, &'static str)> {
    Some(match function {
        Function::PgssStore => (
            "pg_stat_statements recording the statement (its entry's spinlock; a new entry, \
             and evictions when the table is full, under the extension's LWLock)",
            "compare the distinct statements with pg_stat_statements.max (evictions in \
             pg_stat_statements_info.dealloc); track_planning = on doubles the updates of each \
             entry; pg_stat_statements.track = top skips nested statements",
        ),
        Function::SLock => (
            "spinning on a spinlock another backend holds",
            "`--probes s_lock` names the call sites (file and line); fewer backends on the same \
             object at once (a pooler), or less work per call on it",
        ),
        Function::LockRelationOid => (
            "taking relation locks (beyond 16 per transaction through the shared lock table)",
            "a plan that references many relations or partitions locks them all: plan-time \
             pruning (custom plans, constants), fewer partitions, or fewer relations per query",
        ),
        Function::GetCachedPlan => (
            "getting its cached plan: revalidating and locking a generic plan, or planning a \
             custom one",
            "a generic plan locks all it references at every execution, a custom plan is \
             planned at every execution: try the other plan_cache_mode for this statement",
        ),
        Function::VacUpdateDatfrozenxid => (
            "VACUUM's scan of every pg_class row to advance the database's datfrozenxid, \
             which ends each VACUUM command",
            "with many relations, vacuum many tables per VACUUM command (one scan) rather than \
             one table per command, or reduce the number of relations",
        ),
        Function::BtGetroot => (
            "descending from a B-tree's root page, once per index scan",
            "many short index scans of the same index (the inner side of a nested loop) all \
             start at its root page: a hash join, or a scan of the small table instead",
        ),
        // PortalStart is a phase of every statement, which the phase rule speaks of.
        Function::PortalStart => return None,
    })
}

/// What a function's share of a statement is measured against.
#[derive(Clone, Copy)]
pub enum ShareOf<'a> {
    /// The statement's time on and off CPU (off-CPU time was measured).
    Time,
    /// The statement's on-CPU samples (off-CPU time was not measured).
    CpuSamples(&'a Profile),
}

pub fn dominating(
    rows: &[ProbeRow],
    statement_time: &StatementTime,
    min_statement_ns: u64,
    share_of: ShareOf,
) -> Vec<Finding> {
    let mut per_call: BTreeMap<(QueryId, Function), (u64, u64)> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.query_id.is_statement()) {
        let entry = per_call.entry((row.query_id, row.function)).or_default();
        entry.0 += row.calls;
        entry.1 += row.total_ns;
    }
    let mut findings = Vec::new();
    for ((query_id, function), (calls, ns)) in per_call {
        let Some((what, action)) = mechanism(function) else {
            continue;
        };
        let Some(&statement_ns) = statement_time.get(&query_id) else {
            continue;
        };
        if calls < MIN_CALLS || statement_ns < min_statement_ns {
            continue;
        }
        let (share, of) = match share_of {
            ShareOf::Time => (ns as f64 / statement_ns as f64, "time"),
            ShareOf::CpuSamples(profile) => {
                (share_with_frame(profile, query_id, function.name()), "CPU time")
            }
        };
        if share < DOMINANT {
            continue;
        }
        findings.push(Finding {
            kind: "function_dominance",
            severity: if share >= CRITICAL {
                Severity::Critical
            } else {
                Severity::Warning
            },
            title: format!(
                "queryid {query_id} spends {} of its {of} in {}",
                percent(share.min(1.0)),
                function.name()
            ),
            numbers: vec![
                (format!("{} calls", function.name()), calls.to_string()),
                (
                    "µs per call".into(),
                    format!("{:.1}", ns as f64 / calls as f64 / 1e3),
                ),
                (
                    format!("ms in {}", function.name()),
                    format!("{:.1}", ns as f64 / 1e6),
                ),
                (
                    match share_of {
                        ShareOf::Time => "ms of the statement (on CPU + blocked)".into(),
                        ShareOf::CpuSamples(_) => {
                            "ms of the statement on CPU (blocked time not measured)".into()
                        }
                    },
                    format!("{:.1}", statement_ns as f64 / 1e6),
                ),
                ("what it does".into(), what.into()),
            ],
            query_ids: vec![query_id],
            frames: vec![function.name().to_string()],
            action: action.into(),
            cause: Some(StatementCause {
                cause: format!("spend most of their {of} in {}", function.name()),
                figures: vec![format!("{} of its {of}", percent(share.min(1.0)))],
                cost_ns: (share.min(1.0) * statement_ns as f64) as u64,
            }),
        });
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(query_id: i64, function: Function, calls: u64, total_ns: u64) -> ProbeRow {
        ProbeRow {
            query_id: QueryId(query_id),
            function,
            calls,
            total_ns,
            detail: 0,
        }
    }

    #[test]
    fn a_function_with_most_of_a_statements_time_is_named_one_with_little_is_not() {
        let time = StatementTime::from([(QueryId(7), 1_000_000_000), (QueryId(8), 1_000_000_000)]);
        let rows = vec![
            row(7, Function::VacUpdateDatfrozenxid, 20, 900_000_000),
            row(8, Function::LockRelationOid, 3000, 30_000_000),
            // PortalStart is a phase, left to the phase rule.
            row(8, Function::PortalStart, 1000, 900_000_000),
        ];
        let found = dominating(&rows, &time, 1, ShareOf::Time);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].query_ids, vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(found[0]
            .title
            .contains("90.0% of its time in vac_update_datfrozenxid"));
    }

    #[test]
    fn pgss_store_kinds_add_up_and_small_evidence_says_nothing() {
        let time = StatementTime::from([(QueryId(7), 100_000_000)]);
        // pgss_store(exec) and pgss_store(plan) come as two rows of one function.
        let rows = vec![
            row(7, Function::PgssStore, 500, 30_000_000),
            row(7, Function::PgssStore, 500, 30_000_000),
        ];
        assert_eq!(dominating(&rows, &time, 1, ShareOf::Time).len(), 1);
        assert!(
            dominating(&rows, &time, 200_000_000, ShareOf::Time).is_empty(),
            "too short a statement"
        );
        let few = vec![row(7, Function::PgssStore, 5, 90_000_000)];
        assert!(
            dominating(&few, &time, 1, ShareOf::Time).is_empty(),
            "too few calls"
        );
        let unknown = vec![row(0, Function::PgssStore, 500, 90_000_000)];
        assert!(dominating(
            &unknown,
            &StatementTime::from([(QueryId(0), 100_000_000)]),
            1,
            ShareOf::Time
        )
        .is_empty());
    }

    #[test]
    fn without_blocked_time_the_share_comes_from_the_samples() {
        use crate::model::fixtures::{profile, sample};
        // Preempted on a busy host, the calls' wall time is 90% of the statement's CPU time;
        // the samples show the function on the stack in one sample of ten.
        let time = StatementTime::from([(QueryId(7), 1_000_000_000)]);
        let rows = vec![row(7, Function::VacUpdateDatfrozenxid, 500, 900_000_000)];
        let small = profile(vec![
            sample(7, "executor", &["exec_simple_query", "vacuum"], 9),
            sample(7, "executor", &["vacuum", "vac_update_datfrozenxid"], 1),
        ]);
        assert!(
            dominating(&rows, &time, 1, ShareOf::CpuSamples(&small)).is_empty(),
            "named from wall time against CPU time"
        );
        assert_eq!(dominating(&rows, &time, 1, ShareOf::Time).len(), 1);
        let large = profile(vec![
            sample(7, "executor", &["vacuum"], 2),
            sample(
                7,
                "executor",
                &["vacuum", "vac_update_datfrozenxid", "heap_getnext"],
                8,
            ),
            sample(8, "executor", &["other"], 50),
        ]);
        let found = dominating(&rows, &time, 1, ShareOf::CpuSamples(&large));
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].title,
            "queryid 7 spends 80.0% of its CPU time in vac_update_datfrozenxid"
        );
    }
}
