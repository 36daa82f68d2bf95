//! The statement a sample, a probe count or a finding belongs to.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `pg_stat_statements.queryid` / `pg_stat_activity.query_id`, signed as SQL shows it. Zero is
/// not a statement but "not computed yet": every statement's parsing runs before Postgres
/// reports its queryid, and backends without `compute_query_id` stay at zero.
///
/// Written as a decimal string wherever it leaves pgscope (labels, JSON): 64-bit values do not
/// survive JSON numbers in most parsers. Recordings keep it as a JSON number, as before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct QueryId(pub i64);

impl QueryId {
    /// The sample label (and metric label, and log field) that carries it.
    pub const LABEL: &'static str = "queryid";
    /// The value of samples whose statement has no queryid yet.
    pub const NOT_COMPUTED: QueryId = QueryId(0);

    /// Whether it names a statement (not the zero of "not computed yet").
    pub fn is_statement(self) -> bool {
        self != Self::NOT_COMPUTED
    }
}

impl fmt::Display for QueryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Padding and alignment apply, as to the number itself (`{:>21}` in tables).
        fmt::Display::fmt(&self.0, f)
    }
}

/// A normalized query text on one line, whitespace runs folded to one space, cut at `limit`
/// characters with `…`: how a statement is shown beside its queryid.
pub fn shorten(text: &str, limit: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= limit {
        return flat;
    }
    let mut cut: String = flat.chars().take(limit).collect();
    cut.push('…');
    cut
}

impl FromStr for QueryId {
    type Err = std::num::ParseIntError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse().map(QueryId)
    }
}

impl From<i64> for QueryId {
    fn from(value: i64) -> Self {
        QueryId(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_reads_and_writes_as_the_signed_decimal_sql_shows() {
        assert_eq!("-42".parse::<QueryId>(), Ok(QueryId(-42)));
        assert!("x".parse::<QueryId>().is_err());
        assert_eq!(format!("{:>5}|", QueryId(7)), "    7|");
        assert_eq!(QueryId(i64::MIN).to_string(), i64::MIN.to_string());
        assert!(!QueryId::NOT_COMPUTED.is_statement());
        assert!(QueryId(-1).is_statement());
        assert_eq!(serde_json::to_string(&QueryId(-42)).ok().as_deref(), Some("-42"));
    }
}
