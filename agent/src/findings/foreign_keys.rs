//! Statements that spend their CPU in foreign-key checks reading the referencing table whole.
//! Deleting a referenced row, or changing its key, makes Postgres run the foreign key's action
//! for it: a query of the referencing table for the rows that point to it (NO ACTION, RESTRICT)
//! or a change of them (CASCADE, SET NULL, SET DEFAULT). Postgres indexes the referenced key,
//! never the referencing columns: without an index whose leading columns they are, each
//! deleted row costs a sequential scan of the referencing table. The time shows as the
//! statement's finish (AFTER triggers), in a trigger whose queries pg_stat_statements counts
//! apart only with `track = all`.

use super::cpu::{statements, supported_share};
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;

/// The foreign keys' actions this share of a statement's CPU: its executions spend a quarter
/// of their work re-reading another table. Half is critical.
const FK_WARN: f64 = 0.25;
const FK_CRITICAL: f64 = 0.50;
/// The share the samples must support with 95% confidence.
const FK_SUPPORTED: f64 = 0.15;

/// The trigger functions a finding cites, where sampled.
const ACTIONS: [&str; 8] = [
    "SPI_execute_snapshot",
    "ri_restrict",
    "RI_FKey_noaction_del",
    "RI_FKey_noaction_upd",
    "RI_FKey_restrict_del",
    "RI_FKey_restrict_upd",
    "RI_FKey_cascade_del",
    "RI_FKey_cascade_upd",
];

/// The statements of `queries` with [`FK_WARN`] of their CPU in foreign-key actions whose
/// reads of the referencing table were sequential rather than through an index.
pub fn unindexed_foreign_keys(queries: &[StatementCpu], period_ns: u64) -> Vec<Finding> {
    statements(queries)
        .filter_map(|q| {
            let actions = q.fk_actions;
            let share = actions.samples as f64 / q.samples as f64;
            (share >= FK_WARN
                && actions.scan_the_table()
                && supported_share(actions.samples, q.samples) >= FK_SUPPORTED)
                .then(|| finding(q, share, period_ns))
        })
        .collect()
}

fn finding(q: &StatementCpu, share: f64, period_ns: u64) -> Finding {
    let constraint = constraint_sampled(q);
    let named = constraint.as_deref().map_or_else(
        || "a foreign key".to_string(),
        |name| format!("foreign key {name}"),
    );
    let mut numbers = vec![
        (
            "CPU in foreign-key checks of the referencing table".into(),
            percent(share),
        ),
        (
            "of their samples reading it sequentially / through an index".into(),
            format!(
                "{} / {}",
                percent(q.fk_actions.sequential as f64 / q.fk_actions.samples as f64),
                percent(q.fk_actions.by_index as f64 / q.fk_actions.samples as f64)
            ),
        ),
        ("samples".into(), q.samples.to_string()),
    ];
    if let Some(name) = &constraint {
        numbers.push(("constraint".into(), name.clone()));
    }
    Finding {
        kind: "unindexed_foreign_key",
        severity: Severity::warning_or_critical(share, FK_CRITICAL),
        title: format!(
            "queryid {} spends {} of its CPU checking {named}, scanning the referencing table \
             for each row it deletes or updates",
            q.query_id,
            percent(share)
        ),
        numbers,
        query_ids: vec![q.query_id],
        // Kept where sampled (`citations`).
        frames: ACTIONS
            .iter()
            .map(|f| f.to_string())
            .chain(["heap_getnextslot".into()])
            .collect(),
        action: format!(
            "deleting a referenced row, or changing its key, makes Postgres look up the rows \
             that still reference it, once per row; Postgres indexes the referenced key but \
             never the referencing columns, and without an index whose leading columns they \
             are each lookup reads the whole referencing table. Create that index on the \
             referencing table of {named} (CREATE INDEX CONCURRENTLY … ON referencing_table \
             (its columns)); seq_scan of that table in pg_stat_user_tables counts the scans"
        ),
        cause: Some(StatementCause {
            cause: "check foreign keys by scanning the referencing tables".into(),
            figures: vec![format!("{} of its CPU", percent(share))],
            cost_ns: q.fk_actions.samples * period_ns,
        }),
    }
}

/// The constraint whose trigger the statement's samples ran in most (`constraint <name>`
/// labels), where the triggers were labelled.
fn constraint_sampled(q: &StatementCpu) -> Option<String> {
    q.triggers
        .iter()
        .filter_map(|(label, &samples)| Some((label.strip_prefix("constraint ")?, samples)))
        .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(a.0)))
        .map(|(name, _)| name.to_string())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::findings::tests::named;
    use crate::model::statements::ForeignKeyActions;
    use crate::model::QueryId;

    fn statement(query_id: i64, samples: u64, actions: ForeignKeyActions) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(query_id),
            samples,
            fk_actions: actions,
            ..StatementCpu::default()
        }
    }

    fn actions(samples: u64, sequential: u64, by_index: u64) -> ForeignKeyActions {
        ForeignKeyActions {
            samples,
            sequential,
            by_index,
        }
    }

    #[test]
    fn checks_that_scan_the_referencing_table_are_named_with_their_constraint() {
        let mut deleting = statement(7, 200, actions(180, 40, 0));
        deleting.triggers = BTreeMap::from([
            ("constraint fk_child_parent_id_fkey".to_string(), 170),
            ("trigger audit".to_string(), 5),
        ]);
        let found = unindexed_foreign_keys(&[deleting], 1);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(
            found[0]
                .title
                .contains("checking foreign key fk_child_parent_id_fkey"),
            "{}",
            found[0].title
        );
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(180));
    }

    #[test]
    fn indexed_checks_and_small_shares_are_not_named() {
        let found = unindexed_foreign_keys(
            &[
                // Through the index: the remedy in place.
                statement(7, 200, actions(120, 2, 30)),
                // A tenth of the statement.
                statement(8, 200, actions(20, 10, 0)),
                // Checks of a referencing table of a few rows: its fetches are a sliver.
                statement(10, 200, actions(120, 5, 0)),
            ],
            1,
        );
        assert!(found.is_empty(), "{found:?}");
        // Without trigger labels, still named, without a name.
        let found = unindexed_foreign_keys(&[statement(9, 200, actions(90, 30, 0))], 1);
        assert!(
            found[0].title.contains("checking a foreign key"),
            "{}",
            found[0].title
        );
        assert_eq!(found[0].severity, Severity::Warning);
    }
}
