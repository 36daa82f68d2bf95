//! Statements that queue for rows other running transactions hold. An UPDATE, DELETE or
//! SELECT … FOR UPDATE that reaches a row another transaction changed (and has not ended)
//! waits for that transaction: `Lock:transactionid`, and `Lock:tuple` for the sessions queued
//! behind the first waiter. When many sessions change the same few rows at once (a counter, a
//! queue's head, a parent row every child touches) the statement's time goes to the queue,
//! while its own work (pg_stat_statements' mean time less the waits) stays small.
//!
//! A transaction that went idle while holding the rows is another cause, one session's doing:
//! `blockers.rs` names it with its pid. This rule names the contention between transactions
//! that are running, which no single session causes.

use super::{percent, Finding, Severity, StatementCause};
use crate::model::wall_clock::waiting_shares;
use crate::model::{QueryId, StatementWall};
use crate::postgres::blockers::BlockerEvidence;

/// The heavyweight lock waits of row locking, as pg_stat_activity names them.
const ROW_LOCK_WAITS: [&str; 2] = ["Lock:transactionid", "Lock:tuple"];
/// Waiting for rows this share of a statement's time: a statement whose executions spend a
/// quarter of their time in the queue runs a third slower than its own work.
const ROW_LOCKS_WARN: f64 = 0.25;
const ROW_LOCKS_CRITICAL: f64 = 0.50;
/// Polls that must see one session blocking for it to be that session's doing (as
/// `blockers.rs` reports it): a transaction held across polls, not a moment's queue.
const HELD_ACROSS_POLLS: u32 = 2;

/// What the polls of `pg_blocking_pids()` saw hold up `query_id`: the polls of its waiters
/// behind a session running the same statement, behind any, and whether a session that held
/// its transaction across polls while idle in it was among them.
#[derive(Default)]
struct HeldBy {
    same_statement: u32,
    all: u32,
    /// Polls that saw it behind a session idle in its transaction.
    behind_idle: u32,
    idle_session: bool,
}

fn held_by(evidence: Option<&BlockerEvidence>, query_id: QueryId) -> HeldBy {
    let mut held = HeldBy::default();
    for blocker in evidence.map_or(&[][..], |e| &e.blockers[..]) {
        let polls: u32 = blocker
            .waiters
            .values()
            .filter(|w| w.query_ids.contains(&query_id.0))
            .map(|w| w.polls)
            .sum();
        if polls == 0 {
            continue;
        }
        held.all += polls;
        if blocker.query_id == Some(query_id.0) {
            held.same_statement += polls;
        }
        if blocker.idle_in_transaction_polls > 0 {
            held.behind_idle += polls;
        }
        held.idle_session |= blocker.mostly_idle_in_transaction() && blocker.polls >= HELD_ACROSS_POLLS;
    }
    held
}

/// The statements of `walls` that spend [`ROW_LOCKS_WARN`] of their time waiting for other
/// running transactions' row locks. Without off-CPU time there are no waits to read.
pub fn row_lock_contention(walls: &[StatementWall], evidence: Option<&BlockerEvidence>) -> Vec<Finding> {
    waiting_shares(walls, &ROW_LOCK_WAITS)
        .filter_map(|(wall, waited, share)| {
            let query_id = wall.query_id;
            let held = held_by(evidence, query_id);
            // Behind a session idle in its transaction: that session's finding.
            if share < ROW_LOCKS_WARN || held.idle_session {
                return None;
            }
            let mut numbers = vec![
                ("waiting for row locks, of its time".to_string(), percent(share)),
                (
                    "ms waiting for row locks".to_string(),
                    format!("{:.1}", waited as f64 / 1e6),
                ),
            ];
            let own = held.all > 0 && 2 * held.same_statement > held.all;
            if held.all > 0 {
                numbers.push((
                    "polls of pg_blocking_pids() that saw it held up by the same statement".into(),
                    format!("{} of {}", held.same_statement, held.all),
                ));
            }
            let whom = if own {
                "its own executions in other sessions"
            } else if 2 * held.behind_idle > held.all {
                "sessions idle in their transactions"
            } else if held.all > 0 {
                "other running transactions"
            } else {
                "other transactions"
            };
            Some(Finding {
                kind: "row_lock_contention",
                severity: Severity::warning_or_critical(share, ROW_LOCKS_CRITICAL),
                title: format!(
                    "queryid {query_id} spends {} of its time waiting for rows locked by {whom}",
                    percent(share)
                ),
                numbers,
                query_ids: vec![query_id],
                frames: Vec::new(),
                action: "many sessions change the same rows at once (a counter, a queue's head, a \
                         parent row each child updates): each waits for the transaction before it \
                         to end. Keep those transactions short (change the hot row last, just \
                         before COMMIT, and commit without client round trips in between), spread \
                         a counter over several rows summed on read, batch the updates, or take \
                         queue items with SELECT … FOR UPDATE SKIP LOCKED; pg_locks and \
                         pg_blocking_pids() show the queue while it forms"
                    .into(),
                cause: Some(StatementCause {
                    cause: "spend their time waiting for rows other running transactions locked".into(),
                    figures: vec![format!("{} of its time", percent(share))],
                    cost_ns: waited,
                }),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::tests::named;
    use crate::model::wall_clock::{WallPart, CPU};
    use std::collections::BTreeMap;

    use crate::postgres::blockers::{HeldUp, LockBlocker};

    fn wall(query_id: i64, cpu_ms: u64, waits: &[(&str, u64)]) -> StatementWall {
        let mut parts = vec![WallPart {
            name: CPU.into(),
            ns: cpu_ms * 1_000_000,
        }];
        parts.extend(waits.iter().map(|(name, ms)| WallPart {
            name: (*name).into(),
            ns: ms * 1_000_000,
        }));
        StatementWall {
            query_id: QueryId(query_id),
            total_ns: parts.iter().map(|p| p.ns).sum(),
            parts,
        }
    }

    fn blocker(query_id: i64, idle: bool, polls: u32, waiter_query_id: i64) -> LockBlocker {
        LockBlocker {
            pid: 100,
            transaction_start: None,
            state: if idle { "idle in transaction" } else { "active" }.into(),
            polls,
            idle_in_transaction_polls: if idle { polls } else { 0 },
            query_id: Some(query_id),
            transaction_seconds: None,
            state_seconds: None,
            waiters: [(
                200,
                HeldUp {
                    polls,
                    seconds: 0.5 * f64::from(polls),
                    wait_events: ["Lock:transactionid".to_string()].into(),
                    query_ids: [waiter_query_id].into(),
                },
            )]
            .into(),
            queued_behind: BTreeMap::new(),
        }
    }

    #[test]
    fn a_statement_queueing_for_rows_is_named_with_what_held_it() {
        let walls = [
            // 60% of its time behind others' row locks.
            wall(7, 40, &[("Lock:transactionid", 50), ("Lock:tuple", 10)]),
            // 10%: the usual short queue of a busy table.
            wall(8, 90, &[("Lock:transactionid", 10)]),
            // Waiting, but not for rows.
            wall(9, 10, &[("IO:WALSync", 90)]),
        ];
        let evidence = BlockerEvidence {
            polls: 10,
            interval_seconds: 0.5,
            blockers: vec![
                blocker(7, false, 1, 7),
                blocker(7, false, 1, 7),
                blocker(3, false, 1, 7),
            ],
        };
        let found = row_lock_contention(&walls, Some(&evidence));
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(
            found[0].title.contains("its own executions"),
            "{}",
            found[0].title
        );
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(60_000_000));
        assert!(found[0]
            .numbers
            .iter()
            .any(|(what, value)| what.contains("same statement") && value == "2 of 3"));
    }

    #[test]
    fn waits_behind_a_session_idle_in_its_transaction_are_that_sessions_finding() {
        let walls = [wall(7, 40, &[("Lock:transactionid", 60)])];
        let evidence = BlockerEvidence {
            polls: 10,
            interval_seconds: 0.5,
            blockers: vec![blocker(5, true, 8, 7)],
        };
        assert!(row_lock_contention(&walls, Some(&evidence)).is_empty());
        // Without polls the waits alone say it is row locking, not by whom.
        let found = row_lock_contention(&walls, None);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert!(
            found[0].title.ends_with("locked by other transactions"),
            "{}",
            found[0].title
        );
        // Seen once behind a session idle in its transaction (ended before a second poll):
        // named, and said so.
        let once = BlockerEvidence {
            polls: 10,
            interval_seconds: 0.5,
            blockers: vec![blocker(5, true, 1, 7)],
        };
        let found = row_lock_contention(&walls, Some(&once));
        assert!(
            found[0].title.contains("sessions idle in their transactions"),
            "{}",
            found[0].title
        );
    }
}
