//! Off-CPU time of a trace: where backends wait, weighted by nanoseconds, labelled with the
//! wait event in force. Sampled (the default), each thread off CPU at a tick is one sample of a
//! tick's weight; exact, waits long enough arrive with their stacks and the others are exact
//! totals read from the kernel at the end. Time without a stack (idle and client waits, and
//! exact's short waits) is shown as one placeholder frame, so every nanosecond is in the
//! profile.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::model::WaitTables;

/// `out.svg` → `out.offcpu.svg`, `out.pb.gz` → `out.offcpu.pb.gz`: the off-CPU profile is
/// written beside the on-CPU one, in the same format.
pub fn beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, extension) = match name.find('.') {
        // A leading dot is part of the name, not an extension.
        Some(0) | None => (name.as_str(), ""),
        Some(dot) => name.split_at(dot),
    };
    path.with_file_name(format!("{stem}.offcpu{extension}"))
}

fn millis(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// How the off-CPU time was measured, for the summary's first line.
pub enum Measured {
    /// Sampled at each tick of this frequency.
    Sampled { frequency_hz: u64 },
    /// Traced at every context switch; waits shorter than this have no stack.
    Exact { min_stack: Duration },
}

/// The off-CPU part of the summary. Idle time (background processes in their main loops,
/// clients between statements: most of every process's life) is one line unless `show_idle`:
/// among the waits it would push the ones that matter off the table.
pub fn render(waits: &WaitTables, measured: Measured, limit: usize, show_idle: bool) -> String {
    let mut out = String::new();
    let total = waits.total_ns();
    if total == 0 {
        let _ = writeln!(out, "off-CPU: no time off CPU was measured");
        return out;
    }
    let wait_column = match measured {
        Measured::Sampled { frequency_hz } => {
            let _ = writeln!(
                out,
                "off-CPU: {:.1} ms in all, sampled: every thread off CPU at each tick ({frequency_hz} Hz), \
                 weighing the time since the last",
                millis(total)
            );
            "wait event"
        }
        Measured::Exact { min_stack } => {
            let _ = writeln!(
                out,
                "off-CPU: {:.1} ms in all, exact; waits under {} µs ({:.1} ms) are counted without a stack",
                millis(total),
                min_stack.as_micros(),
                millis(waits.short_waits_ns)
            );
            "wait event (when it blocked)"
        }
    };
    let _ = writeln!(
        out,
        "{:<22} {:<36} {:<10} {:>12} {:>7}",
        "backend type", wait_column, "off_cpu", "total ms", "share"
    );
    let shown = waits.by_wait.iter().filter(|row| show_idle || !row.is_idle());
    for row in shown.take(limit) {
        let _ = writeln!(
            out,
            "{:<22} {:<36} {:<10} {:>12.2} {:>6.1}%",
            row.backend_type,
            row.wait,
            row.class,
            millis(row.ns),
            100.0 * row.ns as f64 / total as f64
        );
    }
    if !show_idle {
        let idle: Vec<_> = waits.by_wait.iter().filter(|row| row.is_idle()).collect();
        if !idle.is_empty() {
            let ns: u64 = idle.iter().map(|row| row.ns).sum();
            let _ = writeln!(
                out,
                "{:<22} {:<36} {:<10} {:>12.2} {:>6.1}%  ({} {}: background processes in their \
                 main loops, clients between statements; --off-cpu-idle shows them)",
                "(idle)",
                "",
                "idle",
                millis(ns),
                100.0 * ns as f64 / total as f64,
                idle.len(),
                if idle.len() == 1 { "row" } else { "rows" }
            );
        }
    }
    let mut statements = waits
        .by_query
        .iter()
        .filter(|q| q.query_id.is_statement())
        .peekable();
    if statements.peek().is_some() {
        let _ = writeln!(
            out,
            "\noff-CPU by query (idle client time left out), where it waits:"
        );
        let statements: Vec<_> = statements.collect();
        for query in statements.iter().take(limit) {
            let _ = writeln!(out, "{:>21}", query.query_id);
            for row in query.not_idle().take(3) {
                let _ = writeln!(
                    out,
                    "{:>21}   {:<36} {:<10} {:>10.2} ms  {}",
                    "",
                    row.wait,
                    row.class,
                    millis(row.ns),
                    row.stack
                );
            }
        }
        if statements.len() > limit {
            let rest: u64 = statements
                .iter()
                .skip(limit)
                .map(|q| q.not_idle().map(|w| w.ns).sum::<u64>())
                .sum();
            let _ = writeln!(
                out,
                "… {} more queries: {:.2} ms in all",
                statements.len() - limit,
                millis(rest)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::off_cpu::{without_idle, IDLE_FRAME, SHORT_WAITS_FRAME};
    use crate::model::fixtures::{labelled as sample, off_cpu};

    #[test]
    fn off_cpu_files_go_beside_the_on_cpu_ones() {
        assert_eq!(
            beside(Path::new("/tmp/out.svg")),
            PathBuf::from("/tmp/out.offcpu.svg")
        );
        assert_eq!(
            beside(Path::new("prof.pb.gz")),
            PathBuf::from("prof.offcpu.pb.gz")
        );
        assert_eq!(beside(Path::new("folded")), PathBuf::from("folded.offcpu"));
    }

    #[test]
    fn the_summary_shows_waits_by_event_and_by_query_without_idle_time() {
        let lwlock = [
            ("queryid", "7"),
            ("wait_event", "LWLock:pg_stat_statements"),
            ("off_cpu", "futex"),
        ];
        let profile = off_cpu(vec![
            sample(&["main", "pgss_store", "LWLockAcquire"], &lwlock, 3_000_000),
            sample(&[SHORT_WAITS_FRAME], &lwlock, 1_000_000),
            sample(
                &[IDLE_FRAME],
                &[
                    ("queryid", "7"),
                    ("wait_event", "Client:ClientRead"),
                    ("off_cpu", "idle"),
                ],
                9_000_000,
            ),
        ]);
        assert_eq!(without_idle(&profile).samples.len(), 2);
        let tables = WaitTables::from_profile(&profile);
        let text = render(
            &tables,
            Measured::Exact {
                min_stack: Duration::from_micros(100),
            },
            10,
            false,
        );
        assert!(
            text.contains("13.0 ms in all, exact; waits under 100 µs (1.0 ms)"),
            "{text}"
        );
        let sampled = render(&tables, Measured::Sampled { frequency_hz: 99 }, 10, false);
        assert!(
            sampled.contains("13.0 ms in all, sampled: every thread off CPU at each tick (99 Hz)"),
            "{sampled}"
        );
        assert!(text.contains("LWLock:pg_stat_statements"), "{text}");
        assert!(text.contains("pgss_store ← main"), "{text}");
        assert!(!text.contains("LWLockAcquire"), "{text}");
        // The idle wait is one line of the table by wait event, not under the query.
        let by_query = text.split("off-CPU by query").nth(1).unwrap_or_default();
        assert!(!by_query.contains("Client:ClientRead"), "{text}");
        assert!(!text.contains("Client:ClientRead"), "{text}");
        assert!(
            text.contains("(idle)") && text.contains("9.00   69.2%  (1 row:"),
            "{text}"
        );
        let with_idle = render(&tables, Measured::Sampled { frequency_hz: 99 }, 10, true);
        assert!(
            with_idle.contains("Client:ClientRead") && !with_idle.contains("(idle)"),
            "{with_idle}"
        );
    }

    #[test]
    fn queries_past_the_limit_are_summed() {
        let wait = |query_id: &str, ns: u64| {
            sample(
                &["main", "WaitEventSetWait"],
                &[
                    ("queryid", query_id),
                    ("wait_event", "IO:DataFileRead"),
                    ("off_cpu", "io"),
                ],
                ns,
            )
        };
        let profile = off_cpu(vec![
            wait("1", 5_000_000),
            wait("2", 2_000_000),
            wait("3", 1_500_000),
        ]);
        let text = render(
            &WaitTables::from_profile(&profile),
            Measured::Sampled { frequency_hz: 99 },
            1,
            false,
        );
        assert!(text.contains("… 2 more queries: 3.50 ms in all"), "{text}");
    }
}
