//! The per-query part of the trace summary: for each queryid, its share of the samples and
//! how they split over statement phases, from the `queryid` and `phase` sample labels.

use std::collections::HashMap;
use std::fmt::Write as _;

use exporters::{FrameKind, Profile};

use crate::postgres::phase::Phase;

/// One query's samples.
#[derive(Clone, Debug, PartialEq)]
pub struct QuerySummary {
    pub query_id: i64,
    pub samples: u64,
    /// Samples per phase, in [`Phase::ALL`] order.
    pub by_phase: [u64; Phase::ALL.len()],
    /// The function most samples of this query were in (self time).
    pub hottest_function: Option<String>,
}

impl QuerySummary {
    /// Samples outside every phase function (e.g. protocol handling around the statement).
    pub fn other(&self) -> u64 {
        self.samples - self.by_phase.iter().sum::<u64>()
    }
}

/// Groups samples by queryid, most samples first. Samples without a queryid label (processes
/// with no status entry, or no attribution) are left out.
pub fn summarize(profile: &Profile) -> Vec<QuerySummary> {
    let mut queries: HashMap<i64, (QuerySummary, HashMap<String, u64>)> = HashMap::new();
    for sample in &profile.samples {
        let Some(query_id) = sample.label("queryid").and_then(|v| v.parse().ok()) else {
            continue;
        };
        let (summary, leaves) = queries.entry(query_id).or_insert_with(|| {
            (
                QuerySummary {
                    query_id,
                    samples: 0,
                    by_phase: [0; 7],
                    hottest_function: None,
                },
                HashMap::new(),
            )
        });
        summary.samples += sample.count;
        if let Some(phase) = sample.label("phase") {
            if let Some(index) = Phase::ALL.iter().position(|p| p.label() == phase) {
                summary.by_phase[index] += sample.count;
            }
        }
        if let Some(leaf) = sample.frames.iter().rev().find(|f| f.kind == FrameKind::User) {
            *leaves.entry(leaf.name.to_string()).or_insert(0) += sample.count;
        }
    }
    let mut summaries: Vec<QuerySummary> = queries
        .into_values()
        .map(|(mut summary, leaves)| {
            summary.hottest_function = leaves
                .into_iter()
                .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
                .map(|(name, _)| name);
            summary
        })
        .collect();
    summaries.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.query_id.cmp(&b.query_id)));
    summaries
}

/// A text table: queryid, samples, share of all samples, phase split in percent of the query's
/// samples, hottest function.
pub fn render(summaries: &[QuerySummary], total_samples: u64, limit: usize) -> String {
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
        let _ = writeln!(out, "… {} more queries", summaries.len() - limit);
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
    use exporters::{Frame, ProfileMeta, StackSample};
    use std::sync::Arc;

    fn sample(query_id: &str, phase: Option<&str>, leaf: &str, count: u64) -> StackSample {
        let mut labels = vec![("queryid".to_string(), query_id.to_string())];
        if let Some(phase) = phase {
            labels.push(("phase".to_string(), phase.to_string()));
        }
        StackSample {
            frames: vec![
                Frame {
                    name: Arc::from("main"),
                    kind: FrameKind::User,
                },
                Frame {
                    name: Arc::from(leaf),
                    kind: FrameKind::User,
                },
                Frame {
                    name: Arc::from("do_syscall_64"),
                    kind: FrameKind::Kernel,
                },
            ],
            labels,
            count,
        }
    }

    #[test]
    fn groups_by_query_and_phase() {
        let profile = Profile {
            meta: ProfileMeta::cpu(99, 0, 1),
            samples: vec![
                sample("7", Some("plan"), "standard_planner", 3),
                sample("7", Some("run"), "ExecScan", 6),
                sample("7", None, "pq_getbyte", 1),
                sample("-5", Some("parse"), "base_yyparse", 2),
            ],
        };
        let summaries = summarize(&profile);
        assert_eq!(summaries.len(), 2);
        assert_eq!(summaries[0].query_id, 7);
        assert_eq!(summaries[0].samples, 10);
        assert_eq!(summaries[0].by_phase[2], 3);
        assert_eq!(summaries[0].by_phase[4], 6);
        assert_eq!(summaries[0].other(), 1);
        assert_eq!(summaries[0].hottest_function.as_deref(), Some("ExecScan"));
        assert_eq!(summaries[1].query_id, -5);
        let table = render(&summaries, 12, 10);
        assert!(table.contains("83.3%"), "{table}");
        assert!(
            table
                .lines()
                .nth(1)
                .is_some_and(|l| l.contains("60.0%") && l.ends_with("ExecScan")),
            "{table}"
        );
    }
}
