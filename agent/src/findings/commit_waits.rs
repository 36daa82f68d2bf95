//! Statements whose time goes to waiting for their commits' WAL flush. With
//! `synchronous_commit = on` (the default) a transaction's COMMIT returns once its WAL is on
//! disk: the backend writes and fsyncs the WAL itself (`IO:WALWrite`, `IO:WALSync`) or waits for
//! the backend flushing it (`LWLock:WALWrite`). A statement run in its own transaction (an
//! autocommitted INSERT or UPDATE) pays the WAL device's fsync latency at every execution, and
//! pg_stat_statements, which times the executor, does not show it.

use super::{percent, Finding, Severity, StatementCause};
use crate::model::wall_clock::waiting_shares;
use crate::model::StatementWall;

/// The waits of flushing WAL at commit, as pg_stat_activity names them.
const FLUSH_WAITS: [&str; 3] = ["IO:WALSync", "IO:WALWrite", "LWLock:WALWrite"];
/// Waiting for the flush this share of a statement's time: its executions take a third longer
/// than their own work and the commit's.
const FLUSH_WARN: f64 = 0.25;
const FLUSH_CRITICAL: f64 = 0.50;

/// The statements of `walls` that spend [`FLUSH_WARN`] of their time waiting for WAL flushes.
/// Without off-CPU time there are no waits to read.
pub fn commit_flush_waits(walls: &[StatementWall]) -> Vec<Finding> {
    waiting_shares(walls, &FLUSH_WAITS)
        .filter(|&(_, _, share)| share >= FLUSH_WARN)
        .map(|(wall, waited, share)| {
            let query_id = wall.query_id;
            Finding {
                kind: "commit_flush_waits",
                severity: Severity::warning_or_critical(share, FLUSH_CRITICAL),
                title: format!(
                    "queryid {query_id} spends {} of its time waiting for WAL to be flushed to disk at commit",
                    percent(share)
                ),
                numbers: vec![
                    ("waiting for WAL flushes, of its time".into(), percent(share)),
                    ("ms waiting for WAL flushes".into(), format!("{:.1}", waited as f64 / 1e6)),
                ],
                query_ids: vec![query_id],
                frames: Vec::new(),
                action: "each commit waits until its WAL is on disk, so every transaction pays the \
                         WAL device's fsync latency (pg_test_fsync measures it): do more per \
                         transaction (multi-row INSERT, COPY, several statements per COMMIT), let \
                         concurrent commits share a flush (commit_delay with commit_siblings), or \
                         put pg_wal on storage with a faster flush; where losing the last \
                         transactions on a crash is acceptable (never corruption), SET \
                         synchronous_commit = off for those transactions"
                    .into(),
                cause: Some(StatementCause {
                    cause: "wait for their commits' WAL flush".into(),
                    figures: vec![format!("{} of its time", percent(share))],
                    cost_ns: waited,
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::tests::named;
    use crate::model::wall_clock::{WallPart, CPU};
    use crate::model::QueryId;

    fn wall(query_id: i64, parts: &[(&str, u64)]) -> StatementWall {
        let parts: Vec<WallPart> = parts
            .iter()
            .map(|(name, ms)| WallPart {
                name: (*name).into(),
                ns: ms * 1_000_000,
            })
            .collect();
        StatementWall {
            query_id: QueryId(query_id),
            total_ns: parts.iter().map(|p| p.ns).sum(),
            parts,
        }
    }

    #[test]
    fn statements_waiting_for_their_commits_flush_are_named() {
        let walls = [
            wall(7, &[(CPU, 40), ("IO:WALSync", 50), ("LWLock:WALWrite", 10)]),
            wall(8, &[(CPU, 90), ("IO:WALSync", 10)]),
            wall(9, &[(CPU, 10), ("Lock:transactionid", 90)]),
            // Parsing before the queryid is known is no statement.
            wall(0, &[(CPU, 10), ("IO:WALSync", 90)]),
        ];
        let found = commit_flush_waits(&walls);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(60_000_000));
    }
}
