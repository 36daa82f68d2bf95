//! A function that takes a large part of a statement's CPU by itself, where no other rule
//! speaks of the statement: pgscope knows no mechanism for it, but a DBA still wants it named,
//! with the path Postgres reached it by. It is information (where the time goes, not a
//! diagnosis); grouped with the other statements spending their time in the same function and
//! weighed by what that costs the instance like every statement finding.

use super::cpu::statements;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;

/// Self time in one function at least this share of a statement's CPU: most statements
/// spread their CPU over tens of functions, the largest rarely above a fifth.
const HOT_SHARE: f64 = 0.30;

/// Functions through which a backend waits for its client's next message: a statement whose
/// hottest function is reached through them is idle in a transaction, not busy.
const CLIENT_READ: &[&str] = &["pq_getbyte", "pq_getmessage", "secure_read", "pq_recvbuf"];

/// The statements of `queries` whose hottest function takes [`HOT_SHARE`] of their CPU by
/// itself, unless a finding of `found` already speaks of the statement.
pub fn unexplained(queries: &[StatementCpu], found: &[Finding], period_ns: u64) -> Vec<Finding> {
    statements(queries)
        .filter(|q| !found.iter().any(|f| f.query_ids.contains(&q.query_id)))
        .filter_map(|q| {
            let function = q.hottest_function.as_deref()?;
            let share = q.hottest_self as f64 / q.samples as f64;
            if share < HOT_SHARE {
                return None;
            }
            // Waiting for the client's next command (in a transaction, the statement before it
            // keeps its queryid meanwhile): the client's time, not the statement's work.
            if q.hottest_callers
                .iter()
                .any(|c| CLIENT_READ.contains(&c.as_str()))
            {
                return None;
            }
            let path = (!q.hottest_callers.is_empty()).then(|| q.hottest_callers.join(" → "));
            let syscall = what_it_is(function);
            Some(Finding {
                kind: "hot_function",
                severity: Severity::Info,
                title: format!(
                    "queryid {} spends {} of its CPU in {function} itself{}",
                    q.query_id,
                    percent(share),
                    path.as_deref()
                        .map(|p| format!(", reached through {p}"))
                        .unwrap_or_default()
                ),
                numbers: vec![
                    (format!("samples in {function}"), q.hottest_self.to_string()),
                    ("samples of the statement".into(), q.samples.to_string()),
                ]
                .into_iter()
                .chain(syscall.map(|(what, _)| ("what it is".to_string(), what.to_string())))
                .collect(),
                query_ids: vec![q.query_id],
                frames: vec![function.to_string()],
                action: if let Some((_, action)) = syscall {
                    action
                } else if function.contains("+0x") {
                    "no rule of pgscope's explains this function's share; it is a static function \
                     of a stripped build: a debug file names it (the distribution's -dbgsym or \
                     -debuginfo package, or --debug-dir); the flamegraph filtered on the queryid \
                     shows its callers"
                } else {
                    "no rule of pgscope's explains this function's share: the flamegraph filtered \
                     on the queryid shows its callers; EXPLAIN (ANALYZE, BUFFERS) shows which \
                     plan node does the work"
                }
                .into(),
                cause: Some(StatementCause {
                    cause: format!("spend the largest part of their CPU in {function} itself"),
                    figures: vec![format!(
                        "{} of its CPU{}",
                        percent(share),
                        path.map(|p| format!(", through {p}")).unwrap_or_default()
                    )],
                    cost_ns: q.hottest_self * period_ns,
                }),
            })
        })
        .collect()
}

/// What the functions a statement's time most often ends in do, and what to consider: the C
/// library's system call wrappers (an on-CPU sample there is the kernel working for the
/// statement), and the executor's static functions a stripped build names only through its
/// tables of function pointers (`crate::postgres::pointer_tables`).
fn what_it_is(function: &str) -> Option<(&'static str, &'static str)> {
    if function.starts_with("tts_") && function.ends_with("_getsomeattrs") {
        return Some((
            "deforming tuples: reading a row's columns, one after the other, up to the last \
             one the plan needs",
            "every column before the last one a plan reads is deformed for every row it \
             reads: a wide table read for a column near its end pays for all the columns \
             before it (variable-length and nullable columns first cost most); select fewer \
             or earlier columns, put fixed-width, often-read columns first, or read fewer \
             rows (an index, a narrower table)",
        ));
    }
    if function == "heapam_index_fetch_tuple" {
        return Some((
            "fetching the heap row an index entry points to",
            "an index scan visits the table once per index entry it returns: an index-only \
             scan (a covering index with INCLUDE, and a visibility map kept current by \
             VACUUM) skips the table; a bitmap scan visits each page once",
        ));
    }
    Some(match function.trim_start_matches('_') {
        "fdatasync" | "fsync" | "sync_file_range" | "libc_fdatasync" | "libc_fsync" => (
            "a system call flushing a file to disk: WAL at commit, data files at checkpoints",
            "the kernel flushing to disk on the statement's behalf: at commit it is the WAL \
             flush (synchronous_commit, commit_delay, wal_sync_method and the disk's flush \
             latency decide its cost); fewer, larger transactions flush less often",
        ),
        "send" | "libc_send" | "sendto" | "write" | "libc_write" | "recv" | "libc_recv" | "recvfrom"
        | "read" | "libc_read" => (
            "a system call moving data through a socket or file",
            "the kernel moving the statement's data: for a socket, one round trip per \
             statement (batch statements, pipeline them, or return fewer rows); for files, \
             pages read or written outside shared_buffers",
        ),
        "pread64" | "pwrite64" | "libc_pread64" | "libc_pwrite64" | "pread" | "pwrite" | "preadv"
        | "pwritev" => (
            "a system call reading or writing a relation's or WAL's file",
            "pages read from or written to the kernel's page cache: a working set larger than \
             shared_buffers, or WAL written by the statement",
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::tests::named;
    use crate::model::fixtures::{profile, sample};
    use crate::model::statements::statements as table;
    use crate::model::QueryId;

    #[test]
    fn a_function_with_a_large_self_share_is_named_with_its_path_unless_explained() {
        let p = profile(vec![
            sample(7, "run", &["PortalRun", "ExecScan", "postgres+0x30e0a0"], 60),
            sample(7, "run", &["PortalRun", "ExecScan", "heap_getnext"], 40),
            // Spread over many functions: nothing stands out.
            sample(8, "run", &["PortalRun", "ExecScan", "a"], 25),
            sample(8, "run", &["PortalRun", "ExecScan", "b"], 25),
            sample(8, "run", &["PortalRun", "ExecScan", "c"], 25),
            sample(8, "run", &["PortalRun", "ExecScan", "d"], 25),
            // Explained by another rule already.
            sample(9, "run", &["PortalRun", "_bt_first"], 100),
        ]);
        let explained = Finding {
            kind: "index_descents",
            severity: Severity::Warning,
            title: String::new(),
            numbers: Vec::new(),
            query_ids: vec![QueryId(9)],
            frames: Vec::new(),
            action: String::new(),
            cause: None,
        };
        let found = unexplained(&table(&p), &[explained], 10);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(
            found[0].title,
            "queryid 7 spends 60.0% of its CPU in postgres+0x30e0a0 itself, reached through PortalRun → ExecScan"
        );
        assert_eq!(found[0].severity, Severity::Info);
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(600));
        assert!(found[0].action.contains("debug file"));
        let flushing = profile(vec![
            sample(
                10,
                "commit",
                &["CommitTransaction", "XLogFlush", "postgres+0x1ee810", "fdatasync"],
                60,
            ),
            sample(10, "commit", &["CommitTransaction", "XLogFlush"], 40),
        ]);
        // BEGIN keeps its queryid while the backend waits for the transaction's next command.
        let idle = profile(vec![
            sample(
                12,
                "run",
                &[
                    "PostgresMain",
                    "pq_getbyte",
                    "secure_read",
                    "WaitEventSetWait",
                    "epoll_wait",
                ],
                60,
            ),
            sample(12, "run", &["PostgresMain", "PortalRun"], 40),
        ]);
        assert!(unexplained(&table(&idle), &[], 10).is_empty());
        let found = unexplained(&table(&flushing), &[], 10);
        assert_eq!(
            found[0].title,
            "queryid 10 spends 60.0% of its CPU in fdatasync itself, reached through CommitTransaction → XLogFlush"
        );
        assert!(found[0].action.contains("WAL flush"), "{}", found[0].action);
    }

    #[test]
    fn tuple_deforming_and_heap_fetches_say_what_they_are() {
        let p = profile(vec![
            sample(
                11,
                "run",
                &[
                    "ExecAgg",
                    "SeqNext",
                    "slot_getsomeattrs_int",
                    "tts_buffer_heap_getsomeattrs",
                ],
                58,
            ),
            sample(11, "run", &["ExecAgg", "SeqNext", "heap_getnextslot"], 42),
            sample(
                12,
                "run",
                &["ExecNestLoop", "IndexNext", "heapam_index_fetch_tuple"],
                70,
            ),
            sample(12, "run", &["ExecNestLoop", "IndexNext", "_bt_first"], 30),
        ]);
        let found = unexplained(&table(&p), &[], 10);
        let deforming = found
            .iter()
            .find(|f| f.query_ids == [QueryId(11)])
            .expect("named");
        assert!(deforming.action.contains("wide table"), "{}", deforming.action);
        assert!(deforming
            .numbers
            .iter()
            .any(|(what, value)| what == "what it is" && value.starts_with("deforming tuples")));
        let fetching = found
            .iter()
            .find(|f| f.query_ids == [QueryId(12)])
            .expect("named");
        assert!(fetching.action.contains("index-only scan"), "{}", fetching.action);
    }
}
