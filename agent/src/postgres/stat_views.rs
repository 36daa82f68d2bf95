//! Postgres' instance-wide counters, read when a trace starts and ends: `pg_stat_database`
//! (commits, rollbacks, blocks read and hit, tuples, temporary files, deadlocks, I/O time) and,
//! from PostgreSQL 16, `pg_stat_io` (reads, writes, extends, evictions and fsyncs per kind of
//! process, object and context). Their deltas say what the instance did over the trace in
//! Postgres' own words, beside where the samples say its time went.
//!
//! As for pg_stat_statements (`pgss_counters`), the columns are found in the catalog: every
//! numeric column but the gauges and identifiers, whatever the major has (`pg_stat_database`
//! gained session times in 14, `pg_stat_io` lost `op_bytes` for byte counts in 18).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use tokio_postgres::Client;

use super::catalog_columns::{numeric_columns, quoted};

/// One row's counters, by column name.
pub type Counters = BTreeMap<String, f64>;

/// Both views' counters, each row by its key: a database's name (`(shared objects)` for the
/// row of the shared catalogs), `backend type/object/context` for pg_stat_io.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatViews {
    pub database: BTreeMap<String, Counters>,
    /// Empty before PostgreSQL 16, which has no pg_stat_io.
    pub io: BTreeMap<String, Counters>,
}

/// Numeric columns that do not add up over time: a gauge, an identifier, a unit.
const NOT_COUNTERS: [&str; 3] = ["datid", "numbackends", "op_bytes"];

/// The counting columns of `view`; empty when the view does not exist.
async fn counter_columns(client: &Client, view: &str) -> Result<Vec<String>> {
    let columns = numeric_columns(client, view).await?;
    Ok(columns
        .into_iter()
        .filter(|name| !NOT_COUNTERS.contains(&name.as_str()))
        .collect())
}

/// Every row of `view` keyed by `key` (an SQL expression), its counters as float8.
async fn read_view(client: &Client, view: &str, key: &str) -> Result<BTreeMap<String, Counters>> {
    let columns = counter_columns(client, view).await?;
    if columns.is_empty() {
        return Ok(BTreeMap::new());
    }
    let values: Vec<String> = columns.iter().map(|c| format!("{}::float8", quoted(c))).collect();
    let sql = format!("SELECT {key}, {} FROM {view}", values.join(", "));
    let rows = client
        .query(&sql, &[])
        .await
        .with_context(|| format!("reading {view}"))?;
    let mut out = BTreeMap::new();
    for row in rows {
        let key: String = row.try_get(0)?;
        let mut counters = Counters::new();
        for (i, name) in columns.iter().enumerate() {
            let value: Option<f64> = row.try_get(i + 1)?;
            counters.insert(name.clone(), value.unwrap_or(0.0));
        }
        out.insert(key, counters);
    }
    Ok(out)
}

/// Both views now.
pub async fn read(client: &Client) -> Result<StatViews> {
    Ok(StatViews {
        database: read_view(
            client,
            "pg_catalog.pg_stat_database",
            "coalesce(datname::text, '(shared objects)')",
        )
        .await?,
        io: read_view(
            client,
            "pg_catalog.pg_stat_io",
            "backend_type || '/' || object || '/' || context",
        )
        .await?,
    })
}

/// What each row grew by from `start` to `end`, rows that did not change left out. A row whose
/// counters went down was reset meanwhile (`pg_stat_reset`): it counts from zero.
pub fn delta(start: &StatViews, end: &StatViews) -> StatViews {
    StatViews {
        database: rows_delta(&start.database, &end.database),
        io: rows_delta(&start.io, &end.io),
    }
}

fn rows_delta(
    start: &BTreeMap<String, Counters>,
    end: &BTreeMap<String, Counters>,
) -> BTreeMap<String, Counters> {
    end.iter()
        .filter_map(|(key, counters)| {
            let before = start.get(key).filter(|before| {
                counters
                    .iter()
                    .all(|(name, value)| before.get(name).is_none_or(|b| b <= value))
            });
            let grown: Counters = counters
                .iter()
                .map(|(name, value)| {
                    let was = before.and_then(|b| b.get(name)).copied().unwrap_or(0.0);
                    (name.clone(), value - was)
                })
                .collect();
            grown.values().any(|v| *v > 0.0).then(|| (key.clone(), grown))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pairs: &[(&str, f64)]) -> Counters {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn rows_grow_by_their_difference_and_unchanged_rows_are_left_out() {
        let start = StatViews {
            database: BTreeMap::from([
                ("app".into(), row(&[("xact_commit", 10.0), ("temp_files", 1.0)])),
                ("idle".into(), row(&[("xact_commit", 5.0)])),
            ]),
            io: BTreeMap::new(),
        };
        let end = StatViews {
            database: BTreeMap::from([
                ("app".into(), row(&[("xact_commit", 25.0), ("temp_files", 1.0)])),
                ("idle".into(), row(&[("xact_commit", 5.0)])),
                ("new".into(), row(&[("xact_commit", 2.0)])),
            ]),
            io: BTreeMap::from([("client backend/relation/normal".into(), row(&[("reads", 4.0)]))]),
        };
        let grown = delta(&start, &end);
        assert_eq!(grown.database.len(), 2);
        assert_eq!(grown.database["app"]["xact_commit"], 15.0);
        assert_eq!(grown.database["app"]["temp_files"], 0.0);
        assert_eq!(grown.database["new"]["xact_commit"], 2.0);
        assert_eq!(grown.io["client backend/relation/normal"]["reads"], 4.0);
    }

    #[test]
    fn a_row_reset_meanwhile_counts_from_zero() {
        let start = StatViews {
            database: BTreeMap::from([("app".into(), row(&[("xact_commit", 100.0), ("blks_read", 9.0)]))]),
            io: BTreeMap::new(),
        };
        let end = StatViews {
            database: BTreeMap::from([("app".into(), row(&[("xact_commit", 3.0), ("blks_read", 12.0)]))]),
            io: BTreeMap::new(),
        };
        let grown = delta(&start, &end);
        assert_eq!(grown.database["app"]["xact_commit"], 3.0);
        assert_eq!(grown.database["app"]["blks_read"], 12.0);
    }
}
