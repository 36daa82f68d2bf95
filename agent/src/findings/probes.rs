//! Rules over function-probe counts per queryid.

use std::collections::BTreeMap;

use super::{Finding, Severity, StatementCause};
use crate::bpf::abi::Function;
use crate::model::{ProbeRow, QueryId};

/// Executions needed before a per-execution count means anything.
const MIN_EXECUTIONS: u64 = 10;
/// Relation locks per execution of a cached plan worth a look: a query touching a handful of
/// tables and their indexes stays well under it; a generic plan over a partitioned table
/// locks every partition.
const LOCKS_WARN: f64 = 32.0;
const LOCKS_CRITICAL: f64 = 256.0;

/// Statements that take many relation locks per execution of a cached plan (GetCachedPlan
/// once per execution, LockRelationOid once per relation locked).
pub fn locks_per_execution(rows: &[ProbeRow]) -> Vec<Finding> {
    let mut per_query: BTreeMap<QueryId, (u64, u64, u64)> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.query_id.is_statement()) {
        let entry = per_query.entry(row.query_id).or_default();
        match row.function {
            Function::GetCachedPlan => {
                entry.0 += row.calls;
                entry.2 += row.total_ns;
            }
            Function::LockRelationOid => entry.1 += row.calls,
            _ => {}
        }
    }
    per_query
        .into_iter()
        .filter(|(_, (executions, _, _))| *executions >= MIN_EXECUTIONS)
        .filter_map(|(query_id, (executions, locks, plan_ns))| {
            let per_execution = locks as f64 / executions as f64;
            (per_execution >= LOCKS_WARN).then(|| Finding {
                kind: "generic_plan_locks",
                severity: Severity::warning_or_critical(per_execution, LOCKS_CRITICAL),
                title: format!(
                    "queryid {query_id} takes {per_execution:.0} relation locks per execution of its cached plan"
                ),
                numbers: vec![
                    ("GetCachedPlan calls".into(), executions.to_string()),
                    ("LockRelationOid calls".into(), locks.to_string()),
                    (
                        "µs in GetCachedPlan per execution".into(),
                        format!("{:.1}", plan_ns as f64 / executions as f64 / 1000.0),
                    ),
                ],
                query_ids: vec![query_id],
                frames: vec!["GetCachedPlan".into(), "LockRelationOid".into()],
                action: "a generic plan locks every relation it may touch before run-time pruning (all \
                         partitions of a partitioned table): plan_cache_mode = force_custom_plan for this \
                         statement locks only what each plan keeps; fewer partitions help too; beyond 16 \
                         locks a backend leaves the fast path and takes the lock manager's LWLocks"
                    .into(),
                cause: Some(StatementCause {
                    cause: "take many relation locks per execution of their cached plans".into(),
                    figures: vec![format!("{per_execution:.0} locks per execution")],
                    cost_ns: plan_ns,
                }),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(query_id: i64, function: Function, calls: u64) -> ProbeRow {
        ProbeRow {
            query_id: QueryId(query_id),
            function,
            calls,
            total_ns: calls * 1000,
            detail: 0,
        }
    }

    #[test]
    fn many_locks_per_cached_plan_are_named_few_are_not() {
        let rows = vec![
            row(7, Function::GetCachedPlan, 100),
            row(7, Function::LockRelationOid, 100 * 2049),
            row(8, Function::GetCachedPlan, 100),
            row(8, Function::LockRelationOid, 300),
            // Too few executions.
            row(9, Function::GetCachedPlan, 3),
            row(9, Function::LockRelationOid, 3000),
        ];
        let found = locks_per_execution(&rows);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].query_ids, vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(found[0].title.contains("2049"), "{}", found[0].title);
    }
}
