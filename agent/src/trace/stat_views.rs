//! The summary's lines of Postgres' own instance-wide counters over the trace
//! (`postgres::stat_views`): pg_stat_database summed over the databases, and pg_stat_io's
//! busiest rows.

use std::collections::BTreeMap;
use std::fmt::Write as _;

type Rows = BTreeMap<String, BTreeMap<String, f64>>;

/// pg_stat_io rows printed at most.
const IO_ROWS_SHOWN: usize = 6;

/// Up to two lines; empty when neither view grew.
pub fn render(database: &Rows, io: &Rows) -> String {
    let mut out = String::new();
    if !database.is_empty() {
        // Folded from 0.0: an empty f64 sum is -0.0, printed `-0`.
        let sum = |column: &str| -> f64 {
            database
                .values()
                .filter_map(|row| row.get(column))
                .fold(0.0, |total, value| total + value)
        };
        let (read, hit) = (sum("blks_read"), sum("blks_hit"));
        let hit_pct = match read + hit {
            total if total > 0.0 => format!(" ({:.1}% hit)", 100.0 * hit / total),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  pg_stat_database: {} commits, {} rollbacks, {} blocks read{hit_pct}, {} temporary files ({}), {} deadlocks, {} rows returned, {} fetched",
            sum("xact_commit"),
            sum("xact_rollback"),
            read,
            sum("temp_files"),
            bytes(sum("temp_bytes")),
            sum("deadlocks"),
            sum("tup_returned"),
            sum("tup_fetched"),
        );
    }
    let mut busiest: Vec<(&String, f64, &BTreeMap<String, f64>)> = io
        .iter()
        .map(|(key, row)| {
            let operations = ["reads", "writes", "extends", "fsyncs", "evictions"]
                .iter()
                .filter_map(|c| row.get(*c))
                .sum::<f64>();
            (key, operations, row)
        })
        .filter(|(_, operations, _)| *operations > 0.0)
        .collect();
    busiest.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    if !busiest.is_empty() {
        let rows: Vec<String> = busiest
            .iter()
            .take(IO_ROWS_SHOWN)
            .map(|(key, _, row)| {
                let get = |column: &str| row.get(column).copied().unwrap_or(0.0);
                format!(
                    "{key} {}/{}/{}/{}",
                    get("reads"),
                    get("writes"),
                    get("extends"),
                    get("fsyncs")
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "  pg_stat_io (reads/writes/extends/fsyncs, by process/object/context): {}",
            rows.join(" · ")
        );
    }
    out
}

fn bytes(n: f64) -> String {
    match n {
        n if n >= 1024.0 * 1024.0 * 1024.0 => format!("{:.1} GiB", n / (1024.0 * 1024.0 * 1024.0)),
        n if n >= 1024.0 * 1024.0 => format!("{:.1} MiB", n / (1024.0 * 1024.0)),
        n if n >= 1024.0 => format!("{:.1} KiB", n / 1024.0),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(entries: &[(&str, &[(&str, f64)])]) -> Rows {
        entries
            .iter()
            .map(|(key, pairs)| {
                (
                    key.to_string(),
                    pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn databases_are_summed_and_io_rows_listed_busiest_first() {
        let database = rows(&[
            (
                "app",
                &[
                    ("xact_commit", 90.0),
                    ("blks_read", 10.0),
                    ("blks_hit", 990.0),
                    ("temp_files", 2.0),
                    ("temp_bytes", 3.0 * 1024.0 * 1024.0),
                ],
            ),
            ("postgres", &[("xact_commit", 3.0)]),
        ]);
        let io = rows(&[
            (
                "checkpointer/relation/normal",
                &[("writes", 5.0), ("fsyncs", 2.0)],
            ),
            (
                "client backend/relation/bulkwrite",
                &[("extends", 40.0), ("writes", 0.0)],
            ),
            ("autovacuum worker/relation/vacuum", &[("reads", 0.0)]),
        ]);
        let text = render(&database, &io);
        assert!(
            text.contains("93 commits, 0 rollbacks, 10 blocks read (99.0% hit), 2 temporary files (3.0 MiB)"),
            "{text}"
        );
        assert!(
            text.contains(
                "client backend/relation/bulkwrite 0/0/40/0 · checkpointer/relation/normal 0/5/0/2\n"
            ),
            "{text}"
        );
        assert!(render(&Rows::new(), &Rows::new()).is_empty());
    }
}
