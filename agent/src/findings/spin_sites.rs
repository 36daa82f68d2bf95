//! Spinlocks by call site (`--probes s_lock`): every acquisition that finds its spinlock taken
//! calls `s_lock(lock, file, line, func)`, which names the lock's code. A spinlock guards a
//! few instructions; spinning means several backends want the same one at the same moment,
//! and the time spinning (then sleeping between spins) grows steeply with the backends on it.
//! The share of a statement's time spent there says how close it is to that cliff.

use std::collections::BTreeMap;

use super::{percent, Finding, Severity, StatementCause};
use crate::model::{ProbeRow, QueryId, SpinSiteRow, StatementTime};

/// Spinning this share of a statement's time.
const SPIN_WARN: f64 = 0.05;
const SPIN_CRITICAL: f64 = 0.20;

/// What the lock at a call site guards, by the file it is taken in, and what to consider.
fn lock_of(file: &str) -> (&'static str, &'static str) {
    if file.ends_with("pg_stat_statements.c") {
        (
            "the statement's pg_stat_statements entry, updated after each execution (and \
             each planning with track_planning = on)",
            "many backends running the same statement at once update its one entry, once per \
             execution and once more per planning with pg_stat_statements.track_planning = on \
             (turning it off halves a re-planned statement's updates); fewer backends running \
             it at once (a pooler) spin less",
        )
    } else if file.ends_with("bufmgr.c") || file.ends_with("buf_internals.h") {
        (
            "a shared buffer's header: one page many backends pin at once (an index's root, \
             a small hot table)",
            "look for the hot page: a small table or index read by every statement (the inner \
             side of a nested loop), which a different plan or fewer concurrent backends relieve",
        )
    } else if file.ends_with("freelist.c") {
        (
            "the shared buffers' free list and clock sweep, taken to find a buffer for a page \
             not in shared_buffers",
            "backends evicting pages at once: a working set larger than shared_buffers (raise \
             it, or read less: an index instead of a scan)",
        )
    } else if file.ends_with("xlog.c") || file.ends_with("xloginsert.c") {
        (
            "WAL bookkeeping shared by every writer",
            "many small write transactions at once: batch them, or fewer concurrent writers",
        )
    } else {
        (
            "a short critical section many backends enter at once",
            "the file and line name the code; fewer backends on the same object at once (a \
             pooler), or less work per call on it",
        )
    }
}

/// Call sites where a statement spun over `seconds`, with the share of its time it did: a warning from 5%,
/// information below (how far from the cliff it is).
pub fn spinning_sites(
    sites: &[SpinSiteRow],
    probes: &[ProbeRow],
    statement_time: &StatementTime,
    seconds: f64,
) -> Vec<Finding> {
    let mut merged: BTreeMap<(QueryId, &str, u32, &str), (u64, u64)> = BTreeMap::new();
    for site in sites.iter().filter(|s| s.query_id.is_statement() && s.calls > 0) {
        let entry = merged
            .entry((site.query_id, &site.file, site.line, &site.function))
            .or_default();
        entry.0 += site.calls;
        entry.1 += site.total_ns;
    }
    let entry_updates = |query_id: QueryId| -> u64 {
        probes
            .iter()
            .filter(|p| p.query_id == query_id && p.updates_pgss_entry())
            .map(|p| p.calls)
            .sum()
    };
    let mut findings = Vec::new();
    for ((query_id, file, line, function), (calls, ns)) in merged {
        let Some(&statement_ns) = statement_time.get(&query_id).filter(|&&t| t > 0) else {
            continue;
        };
        let share = ns as f64 / statement_ns as f64;
        let (what, action) = lock_of(file);
        let mut numbers = vec![
            ("acquisitions that spun".to_string(), calls.to_string()),
            ("ms spinning".to_string(), format!("{:.2}", ns as f64 / 1e6)),
            ("share of the statement's time".to_string(), percent(share)),
            ("what the lock guards".to_string(), what.to_string()),
        ];
        let updates = entry_updates(query_id);
        if file.ends_with("pg_stat_statements.c") && updates > 0 {
            numbers.push((
                "entry updates that spun (pgss_store calls)".to_string(),
                format!("{} of {updates}", percent(calls as f64 / updates as f64)),
            ));
            numbers.push((
                "entry updates per second".to_string(),
                format!("{:.0}", updates as f64 / seconds.max(1e-3)),
            ));
        }
        let site = format!("{}:{line} ({function})", short_path(file));
        findings.push(Finding {
            kind: "spin_site",
            severity: match share {
                s if s >= SPIN_CRITICAL => Severity::Critical,
                s if s >= SPIN_WARN => Severity::Warning,
                _ => Severity::Info,
            },
            title: format!(
                "queryid {query_id} spins on the spinlock at {site}: {} of its time",
                percent(share)
            ),
            numbers,
            query_ids: vec![query_id],
            frames: vec![format!("{function} → s_lock")],
            action: action.to_string(),
            cause: Some(StatementCause {
                cause: format!("spin on the spinlock at {site}"),
                figures: vec![format!("{} of its time", percent(share))],
                cost_ns: ns,
            }),
        });
    }
    findings
}

/// `contrib/pg_stat_statements/pg_stat_statements.c` → `pg_stat_statements.c`.
fn short_path(file: &str) -> &str {
    file.rsplit('/').next().unwrap_or(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::abi::Function;

    fn site(query_id: i64, file: &str, calls: u64, total_ns: u64) -> SpinSiteRow {
        SpinSiteRow {
            query_id: QueryId(query_id),
            file: file.into(),
            line: 1347,
            function: "pgss_store".into(),
            calls,
            total_ns,
        }
    }

    #[test]
    fn spinning_is_named_by_call_site_with_its_share_and_severity() {
        let time = StatementTime::from([(QueryId(7), 1_000_000_000), (QueryId(8), 1_000_000_000)]);
        let pgss = "contrib/pg_stat_statements/pg_stat_statements.c";
        let sites = vec![
            site(7, pgss, 300, 250_000_000),
            site(8, "storage/buffer/bufmgr.c", 10, 5_000_000),
            // Not a statement.
            site(0, pgss, 10, 900_000_000),
        ];
        let store = |calls, detail| ProbeRow {
            query_id: QueryId(7),
            function: Function::PgssStore,
            calls,
            total_ns: 0,
            detail,
        };
        // The exec stores update the entry; the text-only ones (simple protocol: every
        // execution parses anew) take no spinlock and are not updates.
        let probes = vec![store(30_000, 3), store(30_000, crate::model::PGSS_TEXT_ONLY)];
        let found = spinning_sites(&sites, &probes, &time, 10.0);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(
            (found[0].query_ids[0], found[0].severity),
            (QueryId(7), Severity::Critical)
        );
        assert!(found[0]
            .title
            .contains("pg_stat_statements.c:1347 (pgss_store): 25.0%"));
        assert!(found[0]
            .numbers
            .iter()
            .any(|(k, v)| k.starts_with("entry updates that spun") && v == "1.0% of 30000"));
        assert!(found[0]
            .numbers
            .iter()
            .any(|(k, v)| k == "entry updates per second" && v == "3000"));
        assert_eq!(
            (found[1].query_ids[0], found[1].severity),
            (QueryId(8), Severity::Info)
        );
        assert!(spinning_sites(&[], &probes, &time, 10.0).is_empty());
    }
}
