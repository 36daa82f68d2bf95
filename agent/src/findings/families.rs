//! Statements that spend their CPU in a part of Postgres whose cost has one usual cause, named
//! from the catalogue's family (`postgres::subsystems`) and its share of the statement's CPU:
//! - `collation_comparisons`: text compared under a linguistic collation. Sorting, grouping,
//!   DISTINCT, merge joins and B-tree searches on text compare values again and again; under
//!   "C" each comparison is a memcmp, under ICU or the C library's locales it goes through the
//!   provider, which weighs accents, case and punctuation in several passes.
//! - `plpgsql_calls`: PL/pgSQL functions called by the statement, usually once per row: the
//!   interpreter runs at every call, where an expression or an inlinable SQL function would be
//!   evaluated inside the executor.
//! - `toast_values`: large values decompressed and reassembled at every read, compressed and
//!   rewritten whole at every change, usually for a small part of each.
//! - `pattern_matches`: text matched against a LIKE pattern or a regular expression in every
//!   row a scan reads, where no index narrows the rows.
//! - `catalog_churn`: relations created and dropped as the statements run (temporary tables
//!   per transaction): system-catalog rows, files and invalidations each time.

use super::cpu::supported_share;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;
use crate::postgres::sql::InstanceFacts;
use crate::postgres::subsystems::{Subsystem, CATALOG_CHANGES, COLLATION, PATTERN_MATCHING, PLPGSQL, TOAST};

/// A family's share of a statement's CPU from which it is worth acting on: a quarter of a
/// statement spent in work with a known cheaper form. Half of it is critical.
const FAMILY_WARN: f64 = 0.25;
const FAMILY_CRITICAL: f64 = 0.50;
/// The share the samples must support with 95% confidence.
const FAMILY_SUPPORTED: f64 = 0.15;

/// Calls over the trace from which a statement runs "again and again" (pg_stat_statements').
const MIN_REPEATS: f64 = 10.0;

/// One rule: the family it reads and what it says.
struct FamilyRule {
    kind: &'static str,
    family: &'static Subsystem,
    /// Named only for a statement pg_stat_statements counted at least [`MIN_REPEATS`] calls of
    /// over the trace, where it could be read: the cause is the repetition (a table created in
    /// every transaction), not one run of the statement (a migration creating partitions).
    repeated: bool,
    /// Read after "queryid N spends X% of its CPU ".
    doing: &'static str,
    /// Read after "N statements ".
    cause: &'static str,
    action: &'static str,
}

const RULES: [FamilyRule; 5] = [
    FamilyRule {
        kind: "collation_comparisons",
        family: &COLLATION,
        repeated: false,
        doing: "comparing text under a linguistic collation",
        cause: "compare text under a linguistic collation",
        action: "the text it sorts, groups or searches is compared through the collation's \
                 provider, not byte by byte. Where the order only has to be consistent (codes, \
                 identifiers, hashes, join keys), COLLATE \"C\" on the column, in the index or \
                 in the ORDER BY makes each comparison a memcmp (an index in \"C\" also serves \
                 LIKE 'prefix%'); where people read the order, sort fewer rows (a LIMIT under \
                 an index in that collation)",
    },
    FamilyRule {
        kind: "plpgsql_calls",
        family: &PLPGSQL,
        repeated: false,
        doing: "in PL/pgSQL functions it calls",
        cause: "spend their CPU in the PL/pgSQL functions they call",
        action: "a PL/pgSQL function called for each row runs its interpreter at every call. \
                 Where it computes an expression, write it in the query or as a LANGUAGE sql \
                 function of one SELECT, which the planner inlines (declared IMMUTABLE or STABLE \
                 as it truly is, without SECURITY DEFINER or SET); where it runs a query per \
                 call, join instead. track_functions = 'pl' counts its calls and time in \
                 pg_stat_user_functions",
    },
    FamilyRule {
        kind: "toast_values",
        family: &TOAST,
        repeated: false,
        doing: "decompressing or compressing large values (TOAST)",
        cause: "spend their CPU decompressing or compressing large values (TOAST)",
        action: "each read of a value stored compressed or out of line (jsonb, text or bytea \
                 over about 2 kB) decompresses and reassembles all of it, even for one key, and \
                 each change compresses and writes all of it again. Keep the fields read for \
                 every row in columns of their own (a generated column, or an expression index \
                 the query can use), read the large column only for the rows returned, and \
                 split documents changed piece by piece; toast_blks_hit and toast_blks_read in \
                 pg_statio_user_tables count the reads",
    },
    FamilyRule {
        kind: "pattern_matches",
        family: &PATTERN_MATCHING,
        repeated: false,
        doing: "matching text against patterns (LIKE, regular expressions)",
        cause: "match text against patterns row by row",
        action: "a pattern no B-tree serves (a leading wildcard, ILIKE, a regular expression) \
                 is tested against every row the scan reads. A trigram index (the pg_trgm \
                 extension, a GIN index with gin_trgm_ops) finds the candidate rows; a pattern \
                 anchored at its start (LIKE 'abc%') can use a B-tree in the \"C\" collation or \
                 with text_pattern_ops; a pattern tested again and again can be computed once \
                 into a column",
    },
    FamilyRule {
        kind: "catalog_churn",
        family: &CATALOG_CHANGES,
        repeated: true,
        doing: "creating and dropping relations (writing the system catalogs)",
        cause: "create and drop relations as they run",
        action: "a table created and dropped in every transaction (a temporary table ON COMMIT \
                 DROP, a staging table) writes rows of pg_class, pg_attribute and pg_type, \
                 creates and unlinks its files and invalidates every session's caches each \
                 time, and bloats the catalogs. Keep the rows in a CTE, a VALUES list or an \
                 array (unnest), or create the table once per session and empty it with DELETE \
                 (TRUNCATE and ON COMMIT DELETE ROWS rebuild its files and indexes at every \
                 commit); pg_stat_sys_tables counts the catalogs' inserted and deleted rows",
    },
];

/// The statements of `queries` with [`FAMILY_WARN`] of their CPU under one rule's family, each
/// named by that rule; `facts` holds their pg_stat_statements counters over the trace, where
/// read.
pub fn family_costs(queries: &[StatementCpu], facts: Option<&InstanceFacts>, period_ns: u64) -> Vec<Finding> {
    let calls = |q: &StatementCpu| -> Option<f64> {
        facts?
            .pgss_deltas_by_query
            .get(&q.query_id.to_string())?
            .get("calls")
            .copied()
    };
    RULES
        .iter()
        .flat_map(|rule| {
            super::cpu::statements(queries).filter_map(move |q| {
                let samples = q.in_subsystem(rule.family);
                let share = samples as f64 / q.samples as f64;
                let once = rule.repeated && calls(q).is_some_and(|calls| calls < MIN_REPEATS);
                (share >= FAMILY_WARN && supported_share(samples, q.samples) >= FAMILY_SUPPORTED && !once)
                    .then(|| finding(rule, q, samples, share, period_ns))
            })
        })
        .collect()
}

fn finding(rule: &FamilyRule, q: &StatementCpu, samples: u64, share: f64, period_ns: u64) -> Finding {
    Finding {
        kind: rule.kind,
        severity: Severity::warning_or_critical(share, FAMILY_CRITICAL),
        title: format!(
            "queryid {} spends {} of its CPU {}",
            q.query_id,
            percent(share),
            rule.doing
        ),
        numbers: vec![
            (format!("CPU {}", rule.family.what), percent(share)),
            ("samples".into(), q.samples.to_string()),
        ],
        query_ids: vec![q.query_id],
        // Kept where sampled under the statement (`citations`).
        frames: rule.family.functions.iter().map(|f| f.to_string()).collect(),
        action: rule.action.into(),
        cause: Some(StatementCause {
            cause: rule.cause.into(),
            figures: vec![format!("{} of its CPU", percent(share))],
            cost_ns: samples * period_ns,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::findings::tests::named;
    use crate::model::QueryId;

    fn statement(query_id: i64, family: &'static str, samples: u64) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(query_id),
            samples: 200,
            subsystems: BTreeMap::from([(family, samples)]),
            ..StatementCpu::default()
        }
    }

    #[test]
    fn statements_comparing_text_under_a_collation_are_named_from_their_share() {
        let found = family_costs(
            &[
                statement(7, "collation", 110),
                statement(8, "collation", 30),
                statement(9, "collation", 60),
            ],
            None,
            1,
        );
        assert_eq!(named(&found), vec![QueryId(7), QueryId(9)]);
        assert!(found.iter().all(|f| f.kind == "collation_comparisons"));
        assert_eq!(found[0].severity, Severity::Critical);
        assert_eq!(found[1].severity, Severity::Warning);
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(110));
        assert!(
            !found[0].action.contains("ICU"),
            "the advice never recommends the cause"
        );
    }

    #[test]
    fn statements_in_plpgsql_are_named_by_their_own_rule() {
        let found = family_costs(
            &[statement(7, "plpgsql", 120), statement(8, "sort", 150)],
            None,
            1,
        );
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(found[0].kind, "plpgsql_calls");
        assert!(found[0].title.contains("in PL/pgSQL functions it calls"));
    }

    #[test]
    fn toast_pattern_and_catalog_work_are_each_named_by_their_rule() {
        let found = family_costs(
            &[
                statement(7, "toast", 120),
                statement(8, "pattern_matching", 90),
                statement(9, "catalog_changes", 180),
                statement(10, "catalog_caches", 180),
            ],
            None,
            1,
        );
        let kinds: Vec<(&str, QueryId)> = found.iter().map(|f| (f.kind, f.query_ids[0])).collect();
        assert_eq!(
            kinds,
            vec![
                ("toast_values", QueryId(7)),
                ("pattern_matches", QueryId(8)),
                ("catalog_churn", QueryId(9)),
            ]
        );
        // The advice is not the cause: no compression method for TOAST, no DDL per
        // transaction for the catalog.
        assert!(!found[0].action.contains("lz4"));
        assert!(found[2].action.contains("a CTE") && found[2].action.contains("empty it with DELETE"));
    }

    #[test]
    fn catalog_work_of_a_statement_run_once_is_not_churn() {
        let migration = statement(7, "catalog_changes", 190);
        let per_transaction = statement(8, "catalog_changes", 190);
        let facts = InstanceFacts {
            pgss_deltas_by_query: BTreeMap::from([
                ("7".to_string(), BTreeMap::from([("calls".to_string(), 1.0)])),
                ("8".to_string(), BTreeMap::from([("calls".to_string(), 2441.0)])),
            ]),
            ..InstanceFacts::default()
        };
        let found = family_costs(&[migration.clone(), per_transaction], Some(&facts), 1);
        assert_eq!(named(&found), vec![QueryId(8)]);
        // Without pg_stat_statements' counts, the share alone.
        assert_eq!(named(&family_costs(&[migration], None, 1)), vec![QueryId(7)]);
    }

    #[test]
    fn a_share_the_samples_do_not_support_is_not_named() {
        let few = StatementCpu {
            query_id: QueryId(7),
            samples: 20,
            subsystems: BTreeMap::from([("collation", 5)]),
            ..StatementCpu::default()
        };
        assert!(family_costs(&[few], None, 1).is_empty());
    }
}
