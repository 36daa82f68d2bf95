//! Statements that spend their CPU comparing text under a linguistic collation. Sorting,
//! grouping, DISTINCT, merge joins and B-tree searches on text compare values again and again;
//! under the "C" collation each comparison is a memcmp, under ICU or the C library's locales
//! it goes through the provider, which weighs accents, case and punctuation in several passes.
//! Where the order is only needed to be consistent (codes, identifiers, hashes, keys joined on)
//! that work buys nothing. Named where a statement's CPU is under the catalogue's `collation`
//! family.

use super::cpu::supported_share;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;
use crate::postgres::subsystems::COLLATION;

/// The collation's share of a statement's CPU from which it is worth acting on: a quarter of a
/// statement spent ordering text the way a dictionary would. Half of it is critical.
const COLLATION_WARN: f64 = 0.25;
const COLLATION_CRITICAL: f64 = 0.50;
/// The share the samples must support with 95% confidence.
const COLLATION_SUPPORTED: f64 = 0.15;

/// The statements of `queries` with [`COLLATION_WARN`] of their CPU under the collation
/// providers.
pub fn collation_comparisons(queries: &[StatementCpu], period_ns: u64) -> Vec<Finding> {
    super::cpu::statements(queries)
        .filter_map(|q| {
            let samples = q.in_subsystem(&COLLATION);
            let share = samples as f64 / q.samples as f64;
            (share >= COLLATION_WARN && supported_share(samples, q.samples) >= COLLATION_SUPPORTED)
                .then(|| finding(q, samples, share, period_ns))
        })
        .collect()
}

fn finding(q: &StatementCpu, samples: u64, share: f64, period_ns: u64) -> Finding {
    Finding {
        kind: "collation_comparisons",
        severity: if share >= COLLATION_CRITICAL {
            Severity::Critical
        } else {
            Severity::Warning
        },
        title: format!(
            "queryid {} spends {} of its CPU comparing text under a linguistic collation",
            q.query_id,
            percent(share)
        ),
        numbers: vec![
            (format!("CPU {}", COLLATION.what), percent(share)),
            ("samples".into(), q.samples.to_string()),
        ],
        query_ids: vec![q.query_id],
        // Kept where sampled under the statement (`citations`).
        frames: COLLATION.functions.iter().map(|f| f.to_string()).collect(),
        action: "the text it sorts, groups or searches is compared through the collation's \
                 provider, not byte by byte. Where the order only has to be consistent (codes, \
                 identifiers, hashes, join keys), COLLATE \"C\" on the column, in the index or \
                 in the ORDER BY makes each comparison a memcmp (an index in \"C\" also serves \
                 LIKE 'prefix%'); where people read the order, sort fewer rows (a LIMIT under \
                 an index in that collation)"
            .into(),
        cause: Some(StatementCause {
            cause: "compare text under a linguistic collation".into(),
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

    fn statement(query_id: i64, collation_samples: u64) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(query_id),
            samples: 200,
            subsystems: BTreeMap::from([("collation", collation_samples)]),
            ..StatementCpu::default()
        }
    }

    #[test]
    fn statements_comparing_text_under_a_collation_are_named_from_their_share() {
        let found = collation_comparisons(&[statement(7, 110), statement(8, 30), statement(9, 60)], 1);
        assert_eq!(named(&found), vec![QueryId(7), QueryId(9)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert_eq!(found[1].severity, Severity::Warning);
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(110));
        assert!(
            !found[0].action.contains("ICU"),
            "the advice never recommends the cause"
        );
    }

    #[test]
    fn a_share_the_samples_do_not_support_is_not_named() {
        let few = StatementCpu {
            query_id: QueryId(7),
            samples: 20,
            subsystems: BTreeMap::from([("collation", 5)]),
            ..StatementCpu::default()
        };
        assert!(collation_comparisons(&[few], 1).is_empty());
    }
}
