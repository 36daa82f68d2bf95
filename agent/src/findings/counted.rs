//! What the rules written from Postgres' own counters share: each statement with what its
//! pg_stat_statements counters grew by over the trace, where pgscope could read them. A rule
//! that confirms a cause with a counter has nothing to say of a statement without them.

use std::collections::BTreeMap;

use super::cpu::statements;
use super::Finding;
use crate::model::StatementCpu;
use crate::postgres::sql::InstanceFacts;

/// One statement's counters' growth over the trace, by pg_stat_statements column.
#[derive(Clone, Copy)]
pub struct Deltas<'a>(&'a BTreeMap<String, f64>);

impl Deltas<'_> {
    /// The growth of column `name`; 0 where the installed version has no such column.
    pub fn get(&self, name: &str) -> f64 {
        self.0.get(name).copied().unwrap_or(0.0)
    }

    /// Every column's growth, by name.
    pub fn all(&self) -> impl Iterator<Item = (&str, f64)> {
        self.0.iter().map(|(name, value)| (name.as_str(), *value))
    }
}

/// `rule` over each statement of `queries` (those with enough samples to judge) whose counters
/// `facts` holds; nothing without facts.
pub fn per_statement(
    queries: &[StatementCpu],
    facts: Option<&InstanceFacts>,
    mut rule: impl FnMut(&StatementCpu, Deltas<'_>) -> Option<Finding>,
) -> Vec<Finding> {
    let Some(facts) = facts else {
        return Vec::new();
    };
    statements(queries)
        .filter_map(|q| {
            let counters = facts.pgss_deltas_by_query.get(&q.query_id.to_string())?;
            rule(q, Deltas(counters))
        })
        .collect()
}

/// Where a statement's counters come from in a unit test: `pairs` as statement 7's.
#[cfg(test)]
pub fn facts_of_statement_7(pairs: &[(&str, f64)]) -> InstanceFacts {
    InstanceFacts {
        pgss_deltas_by_query: BTreeMap::from([(
            "7".to_string(),
            pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
        )]),
        ..InstanceFacts::default()
    }
}
