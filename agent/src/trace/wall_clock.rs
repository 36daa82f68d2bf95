//! The trace summary's wall-clock lines: per queryid, where its time went, on CPU and in each
//! wait (the model's split, rendered).

use std::fmt::Write as _;

use crate::model::StatementWall;

/// One line per statement, most time first: queryid, its time, and the split.
pub fn render(walls: &[StatementWall], limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:>21} {:>10}  split", "queryid", "time ms");
    for wall in walls.iter().take(limit) {
        let _ = writeln!(
            out,
            "{:>21} {:>10.1}  {}",
            wall.query_id,
            wall.total_ns as f64 / 1e6,
            wall.render()
        );
    }
    if walls.len() > limit {
        let rest: u64 = walls.iter().skip(limit).map(|w| w.total_ns).sum();
        let _ = writeln!(
            out,
            "… {} more queries: {:.1} ms in all",
            walls.len() - limit,
            rest as f64 / 1e6
        );
    }
    out.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::wall_clock::WallPart;
    use crate::model::QueryId;

    #[test]
    fn a_line_per_statement_with_its_split() {
        let wall = |id: i64, cpu: u64, lock: u64| StatementWall {
            query_id: QueryId(id),
            total_ns: cpu + lock,
            parts: vec![
                WallPart {
                    name: "LWLock:pg_stat_statements".into(),
                    ns: lock,
                },
                WallPart {
                    name: "CPU".into(),
                    ns: cpu,
                },
            ],
        };
        let text = render(&[wall(7, 380_000_000, 620_000_000), wall(8, 1, 1)], 1);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[1].ends_with("7     1000.0  LWLock:pg_stat_statements 62% · CPU 38%"),
            "{text}"
        );
        assert_eq!(lines[2], "… 1 more queries: 0.0 ms in all");
    }
}
