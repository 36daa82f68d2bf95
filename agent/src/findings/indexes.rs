//! Statements whose CPU goes to starting index scans. Every B-tree index scan descends from
//! the root page (`_bt_getroot`, then `_bt_search` down to a leaf): cheap once, but a plan that
//! starts one index scan per row of another input — the inner side of a nested loop — repeats
//! the descent for every outer row, on the same few pages, which many backends then pin and
//! lock at once.

use super::cpu::statements;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;

/// Starting index scans this share of a statement's CPU: a prepared primary-key lookup, whose
/// whole execution is one index scan, spends 17% there (pgbench -S -M prepared, measured
/// here); a nested loop over a small indexed table spends 64%.
const DESCENTS_WARN: f64 = 0.35;
const DESCENTS_CRITICAL: f64 = 0.60;

pub fn repeated_descents(queries: &[StatementCpu], period_ns: u64) -> Vec<Finding> {
    statements(queries)
        .filter_map(|q| {
            let share = q.index_descents as f64 / q.samples as f64;
            (share >= DESCENTS_WARN).then(|| Finding {
                kind: "index_descents",
                severity: Severity::warning_or_critical(share, DESCENTS_CRITICAL),
                title: format!(
                    "queryid {} spends {} of its CPU descending B-tree indexes from their root, starting index scans over and over",
                    q.query_id,
                    percent(share)
                ),
                numbers: vec![
                    ("in _bt_first / _bt_search / _bt_getroot / btrescan".into(), percent(share)),
                    ("samples".into(), q.samples.to_string()),
                ],
                query_ids: vec![q.query_id],
                frames: vec!["_bt_first".into(), "_bt_search".into(), "_bt_getroot".into()],
                action: "a nested loop starts one index scan of its inner side per outer row: with many \
                         outer rows a hash or merge join reads the inner table once (EXPLAIN ANALYZE: \
                         compare the outer side's estimated and actual rows — a misestimate makes the \
                         planner pick the loop); `--probes _bt_getroot` counts the descents"
                    .into(),
                cause: Some(StatementCause {
                    cause: "spend most of their CPU descending B-tree indexes from their root, \
                            starting index scans over and over"
                        .into(),
                    figures: vec![format!("{} of its CPU", percent(share))],
                    cost_ns: q.index_descents * period_ns,
                }),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{profile, sample};
    use crate::model::statements::statements as table;
    use crate::model::QueryId;

    #[test]
    fn a_statement_mostly_descending_indexes_is_named_a_point_lookup_is_not() {
        let p = profile(vec![
            sample(
                7,
                "run",
                &[
                    "PortalRun",
                    "ExecNestLoop",
                    "ExecReScanIndexScan",
                    "_bt_first",
                    "_bt_search",
                    "_bt_getroot",
                ],
                60,
            ),
            sample(7, "run", &["PortalRun", "ExecNestLoop", "ExecSeqScan"], 30),
            sample(
                7,
                "run",
                &["PortalRun", "ExecNestLoop", "ExecReScanIndexScan", "btrescan"],
                10,
            ),
            sample(
                8,
                "run",
                &["PortalRun", "ExecIndexScan", "_bt_first", "_bt_search"],
                5,
            ),
            sample(8, "parse", &["pg_parse_query", "raw_parser"], 45),
            sample(8, "run", &["PortalRun", "ExecIndexScan", "index_fetch_heap"], 50),
        ]);
        let found = repeated_descents(&table(&p), 1);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].query_ids, vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
    }
}
