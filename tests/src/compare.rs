//! Comparing self-time tables of two profilers.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Self time per function, in percent of all samples.
#[derive(Debug, Clone, Default)]
pub struct SelfTable(pub BTreeMap<String, f64>);

impl SelfTable {
    /// The `n` functions with the most self time, largest first (ties by name).
    pub fn top(&self, n: usize) -> Vec<(String, f64)> {
        let mut rows: Vec<(String, f64)> = self.0.iter().map(|(k, v)| (k.clone(), *v)).collect();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        rows.truncate(n);
        rows
    }

    /// Percentage of `name`, 0 when it has no samples.
    pub fn pct(&self, name: &str) -> f64 {
        self.0.get(name).copied().unwrap_or(0.0)
    }
}

/// One function's share in both tables.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionDiff {
    pub name: String,
    pub a_pct: f64,
    pub b_pct: f64,
}

impl FunctionDiff {
    /// `a_pct - b_pct`, in percentage points.
    pub fn diff(&self) -> f64 {
        self.a_pct - self.b_pct
    }
}

/// Compares the top-`n` self functions of `a` and `b`: every function in either top-`n`, with
/// its share in each full table (a function 11th in one table is compared with its real share,
/// not with 0). Sorted by the larger share, descending.
pub fn compare_top(a: &SelfTable, b: &SelfTable, n: usize) -> Vec<FunctionDiff> {
    let names: BTreeSet<String> = a
        .top(n)
        .into_iter()
        .chain(b.top(n))
        .map(|(name, _)| name)
        .collect();
    let mut rows: Vec<FunctionDiff> = names
        .into_iter()
        .map(|name| FunctionDiff {
            a_pct: a.pct(&name),
            b_pct: b.pct(&name),
            name,
        })
        .collect();
    rows.sort_by(|x, y| {
        y.a_pct
            .max(y.b_pct)
            .total_cmp(&x.a_pct.max(x.b_pct))
            .then_with(|| x.name.cmp(&y.name))
    });
    rows
}

/// The rows whose shares differ by more than `max_pp` percentage points.
pub fn disagreements(rows: &[FunctionDiff], max_pp: f64) -> Vec<&FunctionDiff> {
    rows.iter().filter(|r| r.diff().abs() > max_pp).collect()
}

/// A fixed-width table of `rows` with the two columns titled `a` and `b`.
pub fn format_comparison(rows: &[FunctionDiff], a: &str, b: &str) -> String {
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(8).max(8);
    let mut out = format!("{:<width$}  {a:>8}  {b:>8}  {:>7}\n", "function", "diff pp");
    for r in rows {
        let _ = writeln!(
            out,
            "{:<width$}  {:>7.1}%  {:>7.1}%  {:>+7.1}",
            r.name,
            r.a_pct,
            r.b_pct,
            r.diff()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: &[(&str, f64)]) -> SelfTable {
        SelfTable(rows.iter().map(|(k, v)| (k.to_string(), *v)).collect())
    }

    #[test]
    fn compares_union_of_tops_against_full_tables() {
        let a = table(&[("x", 50.0), ("y", 30.0), ("z", 20.0)]);
        let b = table(&[("x", 40.0), ("y", 20.0), ("z", 21.0), ("w", 19.0)]);
        let rows = compare_top(&a, &b, 2);
        let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["x", "y", "z"]);
        assert_eq!(
            rows[2].a_pct, 20.0,
            "z is outside a's top 2 but compared with its real share"
        );
        let bad: Vec<&str> = disagreements(&rows, 5.0)
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(bad, ["x", "y"]);
        assert!(format_comparison(&rows, "pgscope", "perf").contains("+10.0"));
    }
}
