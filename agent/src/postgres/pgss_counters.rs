//! pg_stat_statements' own counters per statement, read when a trace starts and ends: their
//! deltas say what the statement did meanwhile in Postgres' words (calls, plans, rows, blocks
//! read and written, temporary files, WAL, JIT), beside what the samples say it spent its time
//! on, and confirm or rule out a cause (a sort spilling to disk writes temporary blocks; a
//! statement planned at every call has as many plans as calls).
//!
//! Every additive numeric column the installed version has is read, found in the catalog:
//! the columns differ by major (`blk_read_time` became `shared_blk_read_time` in 17, JIT's
//! deform counters came in 17, `wal_buffers_full` in 18), and no per-major table has to keep
//! up. Means, extremes and deviations are not additive and are left out. Rows are read through
//! `pg_stat_statements(false)`, which does not read the texts' file.

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};
use tokio_postgres::Client;

use super::catalog_columns::{numeric_columns, quoted};

/// One statement's counters, by column name.
pub type Counters = BTreeMap<String, f64>;

/// Columns that identify an entry rather than count.
const KEYS: [&str; 4] = ["userid", "dbid", "toplevel", "queryid"];

/// Whether a numeric column adds up over calls: not a mean, an extreme or a deviation.
fn additive(name: &str) -> bool {
    !["min_", "max_", "mean_", "stddev_"]
        .iter()
        .any(|prefix| name.starts_with(prefix))
        && !KEYS.contains(&name)
}

/// The additive numeric columns of the `pg_stat_statements` view.
async fn counter_columns(client: &Client) -> Result<Vec<String>> {
    let columns = numeric_columns(client, "pg_stat_statements").await?;
    Ok(columns.into_iter().filter(|name| additive(name)).collect())
}

/// Every statement's counters (of `query_ids` only, when given), summed over the users,
/// databases and nesting levels pg_stat_statements keeps apart.
pub async fn read(client: &Client, query_ids: Option<&[i64]>) -> Result<HashMap<i64, Counters>> {
    let columns = counter_columns(client).await?;
    if columns.is_empty() {
        return Ok(HashMap::new());
    }
    let sums: Vec<String> = columns
        .iter()
        .map(|c| format!("sum({})::float8", quoted(c)))
        .collect();
    let filter = if query_ids.is_some() {
        "WHERE queryid = ANY($1)"
    } else {
        ""
    };
    let sql = format!(
        "SELECT queryid, {} FROM pg_stat_statements(false) {filter} GROUP BY queryid",
        sums.join(", ")
    );
    let rows = match query_ids {
        Some(ids) => client.query(&sql, &[&ids]).await,
        None => client.query(&sql, &[]).await,
    }
    .context("reading pg_stat_statements' counters")?;
    let mut by_query = HashMap::with_capacity(rows.len());
    for row in rows {
        let Some(query_id): Option<i64> = row.try_get(0)? else {
            continue;
        };
        let mut counters = Counters::new();
        for (i, name) in columns.iter().enumerate() {
            let value: Option<f64> = row.try_get(i + 1)?;
            counters.insert(name.clone(), value.unwrap_or(0.0));
        }
        by_query.insert(query_id, counters);
    }
    Ok(by_query)
}

/// What a statement's counters grew by from `start` to `end`. An entry evicted and made anew
/// meanwhile (fewer calls at the end) counts from zero, as does one that was not there at the
/// start: its counts since then are all the trace can know of.
pub fn delta(start: Option<&Counters>, end: &Counters) -> Counters {
    let calls = |c: &Counters| c.get("calls").copied().unwrap_or(0.0);
    let start = start.filter(|start| calls(start) <= calls(end));
    end.iter()
        .map(|(name, value)| {
            let before = start.and_then(|s| s.get(name)).copied().unwrap_or(0.0);
            (name.clone(), (value - before).max(0.0))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(pairs: &[(&str, f64)]) -> Counters {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn means_extremes_and_keys_are_not_counters() {
        for name in [
            "calls",
            "total_exec_time",
            "temp_blks_written",
            "wal_bytes",
            "jit_functions",
        ] {
            assert!(additive(name), "{name}");
        }
        for name in [
            "mean_exec_time",
            "max_plan_time",
            "min_exec_time",
            "stddev_exec_time",
            "queryid",
            "dbid",
        ] {
            assert!(!additive(name), "{name}");
        }
        assert_eq!(quoted("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn a_delta_is_the_growth_and_a_renewed_entry_counts_from_zero() {
        let start = counters(&[("calls", 10.0), ("rows", 100.0)]);
        let end = counters(&[("calls", 25.0), ("rows", 130.0), ("plans", 3.0)]);
        assert_eq!(
            delta(Some(&start), &end),
            counters(&[("calls", 15.0), ("rows", 30.0), ("plans", 3.0)])
        );
        // Evicted and made anew: fewer calls than at the start.
        let renewed = counters(&[("calls", 4.0), ("rows", 8.0)]);
        assert_eq!(delta(Some(&start), &renewed), renewed);
        assert_eq!(delta(None, &renewed), renewed);
    }
}
