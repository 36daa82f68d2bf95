//! Off-CPU time of a trace: where backends wait, weighted by blocked nanoseconds, labelled with
//! the wait event in force when they blocked. Waits long enough arrive with their stacks; the
//! others (and idle client waits) are exact totals read from the kernel at the end, shown as one
//! placeholder frame so that every nanosecond is in the profile.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use exporters::{FrameKind, Profile};

use crate::bpf::abi::OffCpuClass;
use crate::collect::off_cpu::SHORT_WAITS_FRAME;

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

/// One row of the wait table: a wait event (or, without one, the kind of wait) per class.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WaitRow {
    pub backend_type: String,
    pub wait: String,
    pub class: String,
    pub ns: u64,
}

/// Off-CPU time per (backend type, wait event, class) over the whole profile, longest first.
pub fn by_wait(profile: &Profile) -> Vec<WaitRow> {
    let mut rows: BTreeMap<(String, String, String), u64> = BTreeMap::new();
    for sample in &profile.samples {
        let backend_type = sample.label("backend_type").unwrap_or("?").to_string();
        let class = sample.label("off_cpu").unwrap_or("?").to_string();
        let wait = sample
            .label("wait_event")
            .unwrap_or("(no wait event)")
            .to_string();
        *rows.entry((backend_type, wait, class)).or_insert(0) += sample.count;
    }
    let mut rows: Vec<WaitRow> = rows
        .into_iter()
        .map(|((backend_type, wait, class), ns)| WaitRow {
            backend_type,
            wait,
            class,
            ns,
        })
        .collect();
    rows.sort_by(|a, b| b.ns.cmp(&a.ns).then(a.wait.cmp(&b.wait)));
    rows
}

/// One wait of one query: its total, and where in Postgres its longest stack waited.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueryWait {
    pub wait: String,
    pub class: String,
    pub ns: u64,
    /// Innermost user frames of its longest stack, innermost first.
    pub stack: String,
    /// Weight of that longest stack.
    longest: u64,
}

/// Per queryid (0 and processes without one left out): its off-CPU time per wait, with the
/// innermost user frames of its longest stack there — where in Postgres it waits. Queries with
/// the most off-CPU time first, and their waits longest first.
pub fn by_query(profile: &Profile) -> Vec<(i64, Vec<QueryWait>)> {
    let mut per_query: BTreeMap<i64, BTreeMap<(String, String), QueryWait>> = BTreeMap::new();
    for sample in &profile.samples {
        let Some(query_id) = sample.label("queryid").and_then(|q| q.parse::<i64>().ok()) else {
            continue;
        };
        if query_id == 0 {
            continue;
        }
        let class = sample.label("off_cpu").unwrap_or("?").to_string();
        let wait = sample
            .label("wait_event")
            .unwrap_or("(no wait event)")
            .to_string();
        let entry = per_query
            .entry(query_id)
            .or_default()
            .entry((wait.clone(), class.clone()))
            .or_insert_with(|| QueryWait {
                wait,
                class,
                ..QueryWait::default()
            });
        entry.ns += sample.count;
        if sample.count > entry.longest {
            entry.longest = sample.count;
            entry.stack = where_it_waits(&sample.frames);
        }
    }
    let mut out: Vec<(i64, Vec<QueryWait>)> = per_query
        .into_iter()
        .map(|(query_id, waits)| {
            let mut rows: Vec<QueryWait> = waits.into_values().collect();
            rows.sort_by_key(|row| std::cmp::Reverse(row.ns));
            (query_id, rows)
        })
        .collect();
    out.sort_by_key(|(_, rows)| std::cmp::Reverse(rows.iter().map(|r| r.ns).sum::<u64>()));
    out
}

/// The four innermost user frames of a stack, innermost first: `sem_wait ← PGSemaphoreLock ←
/// LWLockAcquire ← pgss_store`.
fn where_it_waits(frames: &[exporters::Frame]) -> String {
    frames
        .iter()
        .rev()
        .filter(|f| f.kind == FrameKind::User)
        .take(4)
        .map(|f| f.name.to_string())
        .collect::<Vec<_>>()
        .join(" ← ")
}

fn millis(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The off-CPU part of the summary.
pub fn render(profile: &Profile, min_stack: Duration, limit: usize) -> String {
    let mut out = String::new();
    let total: u64 = profile.samples.iter().map(|s| s.count).sum();
    if total == 0 {
        let _ = writeln!(out, "off-CPU: no time off CPU was measured");
        return out;
    }
    let short: u64 = profile
        .samples
        .iter()
        .filter(|s| s.frames.first().is_some_and(|f| &*f.name == SHORT_WAITS_FRAME))
        .map(|s| s.count)
        .sum();
    let _ = writeln!(
        out,
        "off-CPU: {:.1} ms in all; waits under {} µs ({:.1} ms) are counted without a stack",
        millis(total),
        min_stack.as_micros(),
        millis(short)
    );
    let _ = writeln!(
        out,
        "{:<22} {:<36} {:<10} {:>12} {:>7}",
        "backend type", "wait event (when it blocked)", "off_cpu", "total ms", "share"
    );
    for row in by_wait(profile).iter().take(limit) {
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
    let queries = by_query(profile);
    if !queries.is_empty() {
        let _ = writeln!(
            out,
            "\noff-CPU by query (idle client time left out), where it waits:"
        );
        for (query_id, rows) in queries.iter().take(limit) {
            let _ = writeln!(out, "{query_id:>21}");
            for row in rows
                .iter()
                .filter(|r| r.class != OffCpuClass::Idle.name())
                .take(3)
            {
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
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::off_cpu::{without_idle, IDLE_FRAME};
    use exporters::{Frame, ProfileMeta, StackSample};
    use std::sync::Arc;

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

    fn sample(frames: &[&str], labels: &[(&str, &str)], ns: u64) -> StackSample {
        StackSample {
            frames: frames
                .iter()
                .map(|name| Frame {
                    name: Arc::from(*name),
                    kind: FrameKind::User,
                })
                .collect(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            count: ns,
        }
    }

    #[test]
    fn waits_are_summed_per_event_and_per_query_with_where_they_wait() {
        let lwlock = [
            ("queryid", "7"),
            ("wait_event", "LWLock:pg_stat_statements"),
            ("off_cpu", "futex"),
        ];
        let profile = Profile {
            meta: ProfileMeta::off_cpu(0, 1),
            samples: vec![
                sample(
                    &[
                        "main",
                        "pgss_store",
                        "LWLockAcquire",
                        "PGSemaphoreLock",
                        "sem_wait",
                    ],
                    &lwlock,
                    3_000_000,
                ),
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
            ],
        };
        let rows = by_wait(&profile);
        assert_eq!(rows[0].wait, "Client:ClientRead");
        assert_eq!(rows[0].backend_type, "?");
        assert_eq!(rows[1].ns, 4_000_000);
        let queries = by_query(&profile);
        let (query_id, waits) = &queries[0];
        assert_eq!(*query_id, 7);
        let lwlock_row = waits.iter().find(|r| r.class == "futex").expect("futex row");
        assert_eq!(lwlock_row.ns, 4_000_000);
        assert_eq!(
            lwlock_row.stack,
            "sem_wait ← PGSemaphoreLock ← LWLockAcquire ← pgss_store"
        );
        assert_eq!(without_idle(&profile).samples.len(), 2);
        let text = render(&profile, Duration::from_micros(100), 10);
        assert!(text.contains("LWLock:pg_stat_statements"), "{text}");
        assert!(!text.contains("Client:ClientRead           idle"), "{text}");
    }
}
