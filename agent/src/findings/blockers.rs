//! Sessions that hold heavyweight locks others queue on: who blocks whom, from the polls of
//! `pg_blocking_pids()` (`postgres::blockers`). The classic is a client that opened a
//! transaction, changed rows and went idle without ending it: every session that touches
//! those rows waits on `Lock:transactionid` (or `Lock:tuple` behind the first waiter) for as
//! long as it stays open, and nothing in the waiters' own statements says why.

use super::{group::StatementCause, percent, Finding, Severity};
use crate::model::QueryId;
use crate::postgres::blockers::{BlockerEvidence, LockBlocker};

/// Below this share of the backends' time the waits a blocker caused are not reported.
const MIN_SHARE: f64 = 0.005;
/// Polls one transaction must be seen blocking in: a lock held from one poll to the next
/// (half a second), not for a moment. Under contention on hot rows each holder's transaction
/// lasts milliseconds and is seen by one poll at most; that contention is the waits'
/// findings' to report (`Lock:transactionid` by statement), not one session's doing.
const MIN_POLLS: u32 = 2;
/// Shares of the backends' time (on CPU and blocked) spent waiting behind one session.
const WARN_SHARE: f64 = 0.05;
const CRITICAL_SHARE: f64 = 0.20;
/// The wait of a session queued for a lock on a relation.
const TABLE_LOCK_WAIT: &str = "Lock:relation";
/// Blockers reported at most, the costliest first.
const MAX_BLOCKERS: usize = 5;
/// Pids listed in a finding at most.
const MAX_PIDS: usize = 8;

/// One finding per session whose lock waits cost at least [`MIN_SHARE`] of `backend_ns`, the
/// backends' time on CPU and blocked (the waits behind it are part of it where off-CPU time
/// was measured; where not, they are added to it).
pub fn blocking_sessions(evidence: Option<&BlockerEvidence>, backend_ns: u64) -> Vec<Finding> {
    let Some(evidence) = evidence else {
        return Vec::new();
    };
    evidence
        .blockers
        .iter()
        .filter_map(|blocker| {
            let waited_ns = blocker.waiter_seconds() * 1e9;
            let share = waited_ns / (backend_ns as f64).max(waited_ns).max(1.0);
            (share >= MIN_SHARE && blocker.polls >= MIN_POLLS)
                .then(|| finding(blocker, evidence, waited_ns, share))
        })
        .take(MAX_BLOCKERS)
        .collect()
}

fn finding(blocker: &LockBlocker, evidence: &BlockerEvidence, waited_ns: f64, share: f64) -> Finding {
    let severity = match share {
        s if s >= CRITICAL_SHARE => Severity::Critical,
        s if s >= WARN_SHARE => Severity::Warning,
        _ => Severity::Info,
    };
    let held_up = blocker.waiters.len();
    let sessions = if held_up == 1 { "session" } else { "sessions" };
    let seconds = |s: Option<f64>| s.map_or("unknown".to_string(), |s| format!("{s:.1} s"));
    let idle = blocker.mostly_idle_in_transaction();
    let who = match (blocker.pid, idle) {
        (0, _) => "a prepared transaction".to_string(),
        (pid, true) => format!(
            "session {pid}, idle in transaction for {},",
            seconds(blocker.state_seconds)
        ),
        (pid, false) => format!("session {pid} ({})", blocker.state),
    };
    let title = format!(
        "{who} holds locks {held_up} {sessions} waited for: {:.1} s of their time",
        waited_ns / 1e9
    );
    let mut pids: Vec<String> = blocker
        .waiters
        .keys()
        .take(MAX_PIDS)
        .map(i32::to_string)
        .collect();
    if held_up > MAX_PIDS {
        pids.push(format!("… {} more", held_up - MAX_PIDS));
    }
    let wait_events: std::collections::BTreeSet<&str> = blocker
        .waiters
        .values()
        .flat_map(|w| w.wait_events.iter().map(String::as_str))
        .collect();
    let mut numbers = vec![
        ("blocking pid".to_string(), blocker.pid.to_string()),
        ("its state".to_string(), blocker.state.clone()),
        (
            "its transaction open for".to_string(),
            seconds(blocker.transaction_seconds),
        ),
        (
            format!("{sessions} held up"),
            format!("{held_up} (pid {})", pids.join(", ")),
        ),
        (
            "their waits".to_string(),
            wait_events.into_iter().collect::<Vec<_>>().join(", "),
        ),
        (
            format!(
                "time they waited behind it (polled every {:.1} s, {} polls)",
                evidence.interval_seconds, evidence.polls
            ),
            format!("{:.1} s", waited_ns / 1e9),
        ),
        ("share of the backends' time".to_string(), percent(share)),
    ];
    if blocker.pid == 0 {
        numbers.retain(|(what, _)| what != "blocking pid" && what != "its state");
    }
    // The blocker's statement first, then the waiters'.
    let mut query_ids: Vec<QueryId> = blocker.query_id.map(QueryId).into_iter().collect();
    let mut figures: Vec<String> = query_ids
        .iter()
        .map(|_| "the blocker's last statement".to_string())
        .collect();
    for query_id in blocker.waiters.values().flat_map(|w| w.query_ids.iter()) {
        let query_id = QueryId(*query_id);
        if !query_ids.contains(&query_id) {
            query_ids.push(query_id);
            figures.push("waiting".to_string());
        }
    }
    // Sessions queued behind a waiting request for a table lock (a DDL statement's ACCESS
    // EXCLUSIVE): they would not conflict with this transaction, yet wait as long as it runs.
    let table_queue: Vec<String> = blocker
        .queued_behind
        .iter()
        .filter(|(_, event)| event.as_str() == TABLE_LOCK_WAIT)
        .map(|(pid, _)| pid.to_string())
        .collect();
    if !table_queue.is_empty() {
        numbers.push((
            "sessions queued behind a waiting table lock request of".to_string(),
            format!("pid {}", table_queue.join(", ")),
        ));
    }
    let queue_advice = (!table_queue.is_empty()).then(|| {
        format!(
            "session {} waits for a lock on a table this transaction uses (a DDL statement such \
             as ALTER TABLE needs ACCESS EXCLUSIVE), and every later statement on that table \
             queues behind its request though it does not conflict with this transaction: run \
             DDL with SET lock_timeout = '2s' and retry it, so that it gives up rather than stop \
             the table; and ",
            table_queue.join(", ")
        )
    });
    let action = match (blocker.pid, idle) {
        (0, _) => "a prepared transaction holds its locks until it is finished: COMMIT PREPARED or \
                   ROLLBACK PREPARED it (pg_prepared_xacts names it); whatever prepared it and \
                   went away should finish its transactions"
            .to_string(),
        (pid, true) => format!(
            "the application opened a transaction, took locks and left it idle: end transactions \
             in the application before waiting on anything else, and set \
             idle_in_transaction_session_timeout so that Postgres ends such sessions; to release \
             the waiters now, SELECT pg_terminate_backend({pid})"
        ),
        (_, false) => "its transaction keeps its locks until it ends: shorten the transaction (or \
                       its statement, above), or have the sessions that wait take their locks in \
                       the same order"
            .to_string(),
    };
    let action = match queue_advice {
        Some(queue) => format!("{queue}{action}"),
        None => action,
    };
    Finding {
        kind: "lock_blocker",
        severity,
        title,
        numbers,
        query_ids,
        frames: Vec::new(),
        action,
        cause: Some(StatementCause {
            cause: format!("wait behind the locks of session {}", blocker.pid),
            figures,
            cost_ns: waited_ns as u64,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::postgres::blockers::HeldUp;

    fn evidence(state: &str, idle_polls: u32, waiter_polls: u32) -> BlockerEvidence {
        let held = |event: &str| HeldUp {
            polls: waiter_polls,
            seconds: f64::from(waiter_polls) * 0.5,
            wait_events: BTreeSet::from([event.to_string()]),
            query_ids: BTreeSet::from([42]),
        };
        BlockerEvidence {
            polls: 20,
            interval_seconds: 0.5,
            blockers: vec![LockBlocker {
                pid: 4242,
                transaction_start: Some(1.8e9),
                state: state.to_string(),
                polls: 20,
                idle_in_transaction_polls: idle_polls,
                query_id: Some(7),
                transaction_seconds: Some(12.0),
                state_seconds: Some(11.5),
                waiters: BTreeMap::from([(1, held("Lock:transactionid")), (2, held("Lock:tuple"))]),
                queued_behind: BTreeMap::new(),
            }],
        }
    }

    #[test]
    fn a_queue_behind_a_waiting_table_lock_request_names_the_request_and_lock_timeout() {
        let mut evidence = evidence("active", 0, 20);
        evidence.blockers[0].queued_behind = BTreeMap::from([(3, "Lock:relation".to_string())]);
        let found = blocking_sessions(Some(&evidence), 40_000_000_000);
        let f = &found[0];
        assert!(
            f.action.starts_with("session 3 waits for a lock on a table"),
            "{}",
            f.action
        );
        assert!(f.action.contains("lock_timeout"), "{}", f.action);
        assert!(f
            .numbers
            .iter()
            .any(|(what, value)| what.starts_with("sessions queued behind") && value == "pid 3"));
        // Without such a queue, no word of it.
        let plain = blocking_sessions(Some(&evidence_plain()), 40_000_000_000);
        assert!(!plain[0].action.contains("lock_timeout"), "{}", plain[0].action);
    }

    fn evidence_plain() -> BlockerEvidence {
        evidence("active", 0, 20)
    }

    #[test]
    fn an_idle_transaction_holding_others_up_is_named_with_its_pid_and_their_time() {
        let evidence = evidence("idle in transaction", 20, 20);
        // 2 waiters × 20 polls × 0.5 s = 20 s of waiting, out of 40 s of backend time.
        let found = blocking_sessions(Some(&evidence), 40_000_000_000);
        assert_eq!(found.len(), 1);
        let f = &found[0];
        assert_eq!(f.severity, Severity::Critical);
        assert!(
            f.title
                .starts_with("session 4242, idle in transaction for 11.5 s, holds locks 2 sessions"),
            "{}",
            f.title
        );
        assert!(f.title.ends_with("20.0 s of their time"), "{}", f.title);
        assert!(f.action.contains("pg_terminate_backend(4242)"), "{}", f.action);
        assert!(f.action.contains("idle_in_transaction_session_timeout"));
        assert_eq!(f.query_ids, vec![QueryId(7), QueryId(42)]);
        let waits = f
            .numbers
            .iter()
            .find(|(w, _)| w == "their waits")
            .map(|(_, v)| v.as_str());
        assert_eq!(waits, Some("Lock:transactionid, Lock:tuple"));
        assert!(
            f.frames.is_empty(),
            "a blocker finding cites no frame it did not sample"
        );
    }

    #[test]
    fn a_short_hold_is_not_a_finding_and_an_active_blocker_is_not_called_idle() {
        // 2 waiters × 1 poll × 0.5 s = 1 s of 1000 s: 0.1%.
        assert!(blocking_sessions(Some(&evidence("active", 0, 1)), 1_000_000_000_000).is_empty());
        let found = blocking_sessions(Some(&evidence("active", 0, 20)), 200_000_000_000);
        assert_eq!(found[0].severity, Severity::Warning);
        assert!(
            found[0].title.starts_with("session 4242 (active)"),
            "{}",
            found[0].title
        );
        assert!(!found[0].action.contains("pg_terminate_backend"));
        assert!(blocking_sessions(None, 1).is_empty());
    }

    #[test]
    fn a_transaction_seen_blocking_by_one_poll_only_is_not_named() {
        // Hot rows: each holder's transaction lasts milliseconds; a poll catches it once.
        let mut evidence = evidence("active", 0, 1);
        evidence.blockers[0].polls = 1;
        assert!(blocking_sessions(Some(&evidence), 2_000_000_000).is_empty());
        evidence.blockers[0].polls = 2;
        assert_eq!(blocking_sessions(Some(&evidence), 2_000_000_000).len(), 1);
    }
}
