//! The per-query part of the trace summary: for each queryid, its share of the samples and
//! how they split over statement phases (the model's per-statement table, rendered).

use std::fmt::Write as _;

use crate::model::StatementCpu;
use crate::postgres::phase::Phase;

/// A text table: queryid, samples, share of all samples, phase split in percent of the query's
/// samples, hottest function.
pub fn render(summaries: &[StatementCpu], total_samples: u64, limit: usize) -> String {
    let mut out = String::new();
    let _ = write!(out, "{:>21} {:>8} {:>6}", "queryid", "samples", "share");
    for phase in Phase::ALL {
        let _ = write!(out, " {:>6}", short(phase));
    }
    let _ = writeln!(out, " {:>6}  hottest function", "other");
    for summary in summaries.iter().take(limit) {
        let pct = |n: u64| {
            if summary.samples == 0 {
                0.0
            } else {
                100.0 * n as f64 / summary.samples as f64
            }
        };
        let share = if total_samples == 0 {
            0.0
        } else {
            100.0 * summary.samples as f64 / total_samples as f64
        };
        let _ = write!(
            out,
            "{:>21} {:>8} {:>5.1}%",
            summary.query_id, summary.samples, share
        );
        for n in summary.by_phase {
            let _ = write!(out, " {:>5.1}%", pct(n));
        }
        let _ = writeln!(
            out,
            " {:>5.1}%  {}",
            pct(summary.other()),
            summary.hottest_function.as_deref().unwrap_or("-")
        );
    }
    if summaries.len() > limit {
        let rest: u64 = summaries.iter().skip(limit).map(|s| s.samples).sum();
        let share = match total_samples {
            0 => 0.0,
            total => 100.0 * rest as f64 / total as f64,
        };
        let _ = writeln!(
            out,
            "… {} more queries: {rest} samples, {share:.1}% in all",
            summaries.len() - limit
        );
    }
    out
}

fn short(phase: Phase) -> &'static str {
    match phase {
        Phase::Parse => "parse",
        Phase::Analyze => "analyz",
        Phase::Plan => "plan",
        Phase::ExecutorStart => "start",
        Phase::Run => "run",
        Phase::Finish => "finish",
        Phase::Commit => "commit",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{profile, sample};
    use crate::model::statements::statements;

    #[test]
    fn a_row_per_query_with_its_share_phases_and_hottest_function() {
        let mut outside = sample(7, "run", &["main", "pq_getbyte"], 1);
        outside.labels.retain(|(k, _)| k != crate::model::labels::PHASE);
        let p = profile(vec![
            sample(7, "plan", &["main", "standard_planner"], 3),
            sample(7, "run", &["main", "ExecScan"], 6),
            outside,
            sample(-5, "parse", &["main", "base_yyparse"], 2),
        ]);
        let table = render(&statements(&p), 12, 10);
        assert!(table.contains("83.3%"), "{table}");
        assert!(
            table
                .lines()
                .nth(1)
                .is_some_and(|l| l.contains("60.0%") && l.ends_with("ExecScan")),
            "{table}"
        );
        assert!(
            table
                .lines()
                .nth(2)
                .is_some_and(|l| l.trim_start().starts_with("-5")),
            "{table}"
        );
        let top = render(&statements(&p), 12, 1);
        assert!(!top.contains("-5"), "{top}");
        assert!(
            top.lines()
                .last()
                .is_some_and(|l| l == "… 1 more queries: 2 samples, 16.7% in all"),
            "the rest is summed: {top}"
        );
    }
}
