//! The summary's inclusive views: each busy statement's hot paths, and the time per module
//! (the executable, each library, the kernel). A top list by self time shows neither a
//! library whose functions are each small nor a function whose time is in its callees.

use std::fmt::Write as _;

use exporters::ModuleShare;

use crate::model::hot_paths::path_text;
use crate::model::StatementCpu;

/// Statements whose hot paths are printed at most (every statement's are in the JSON).
const STATEMENTS_SHOWN: usize = 5;
/// Hot paths printed per statement at most.
const PATHS_SHOWN: usize = 4;
/// A statement's hot paths are printed when it holds this share of all samples.
const MIN_STATEMENT_SHARE: f64 = 0.01;

/// Per statement, busiest first: its hot paths, each with its share of the statement's
/// samples and, when the last frame runs itself, that share too. Empty when no statement has
/// a hot path.
pub fn render_statements(statements: &[StatementCpu], total_samples: u64, limit: usize) -> String {
    let mut out = String::new();
    let busy = statements
        .iter()
        .filter(|s| !s.hot_paths.is_empty())
        .filter(|s| s.samples as f64 >= total_samples as f64 * MIN_STATEMENT_SHARE)
        .take(limit.min(STATEMENTS_SHOWN));
    for statement in busy {
        let pct = |n: u64| 100.0 * n as f64 / statement.samples.max(1) as f64;
        let _ = writeln!(
            out,
            "  queryid {} ({} samples)",
            statement.query_id, statement.samples
        );
        for path in statement.hot_paths.iter().take(PATHS_SHOWN) {
            let own = match path.self_count {
                0 => String::new(),
                n => format!("  (itself {:.1}%)", pct(n)),
            };
            let _ = writeln!(
                out,
                "    {:>5.1}%  {}{own}",
                pct(path.count),
                path_text(path, statement.samples)
            );
        }
    }
    out
}

/// `self%  total%  samples  module`, most self samples first, at most `limit` rows.
pub fn render_modules(modules: &[ModuleShare], limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:>7}  {:>7}  {:>7}  module", "self%", "total%", "samples");
    for module in modules.iter().take(limit) {
        let _ = writeln!(
            out,
            "{:>6.2}%  {:>6.2}%  {:>7}  {}",
            module.self_pct,
            module.total_pct,
            module.self_count,
            exporters::sanitize(&module.name)
        );
    }
    if modules.len() > limit {
        let _ = writeln!(out, "… {} more modules", modules.len() - limit);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use exporters::{Frame, FrameKind, HotPath, PathStep};

    use super::*;
    use crate::model::QueryId;

    fn statement(query_id: i64, samples: u64, paths: Vec<HotPath>) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(query_id),
            samples,
            hot_paths: paths,
            ..StatementCpu::default()
        }
    }

    fn hot(names: &[&str], count: u64, self_count: u64) -> HotPath {
        HotPath {
            steps: names
                .iter()
                .map(|name| PathStep {
                    frame: Frame {
                        name: Arc::from(*name),
                        kind: FrameKind::User,
                        module: None,
                    },
                    count,
                })
                .collect(),
            count,
            self_count,
        }
    }

    #[test]
    fn each_busy_statement_lists_its_paths_with_their_shares() {
        let statements = [
            statement(7, 200, vec![hot(&["ExecSort", "qsort_tuple"], 120, 100)]),
            // Under 1% of all samples: left out.
            statement(8, 5, vec![hot(&["ExecScan"], 5, 5)]),
        ];
        let text = render_statements(&statements, 1000, 20);
        assert_eq!(
            text,
            "  queryid 7 (200 samples)\n     60.0%  ExecSort → qsort_tuple  (itself 50.0%)\n"
        );
    }

    #[test]
    fn modules_are_listed_up_to_the_limit() {
        let row = |name: &str, self_count: u64| ModuleShare {
            name: Arc::from(name),
            self_count,
            total_count: self_count,
            self_pct: self_count as f64,
            total_pct: self_count as f64,
        };
        let text = render_modules(
            &[row("postgres", 60), row("libc.so.6", 30), row("[kernel]", 10)],
            2,
        );
        assert!(text.contains(" 60.00%   60.00%       60  postgres\n"), "{text}");
        assert!(text.ends_with("… 1 more modules\n"), "{text}");
    }
}
