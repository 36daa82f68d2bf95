//! Who blocks whom: the sessions holding heavyweight locks that others wait for, read with
//! `pg_blocking_pids()` for each backend pg_stat_activity shows in a `Lock:*` wait, polled
//! while samples are taken (`collect::blockers`), and folded into one record per blocking session. A waiter held up by a
//! session that itself waits is charged to the end of the chain: the session that holds the
//! lock and waits for nothing (an `idle in transaction` client, a long statement).
//!
//! `pg_blocking_pids()` takes every lock-manager partition lock in shared mode for a moment;
//! a poll calls it only for backends already waiting on a lock, and for at most
//! [`WAITERS_PER_POLL`] of them. Only queryids are read, never `pg_stat_activity.query`,
//! whose text holds the statement's literal values.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result};
use tokio_postgres::Client;

/// Lock waiters a poll asks `pg_blocking_pids()` about, at most: each call scans the lock
/// table under its partition locks.
pub const WAITERS_PER_POLL: i64 = 64;

/// One waiter and one session it waits for, as one poll saw them.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockedPair {
    pub waiter: i32,
    /// `Lock:transactionid`, `Lock:tuple`, …
    pub wait_event: String,
    pub waiter_query_id: Option<i64>,
    pub blocker: Blocker,
}

/// A session holding a lock, as pg_stat_activity showed it at the poll. Pid 0 is a prepared
/// transaction (it has no session); fields are None where pgscope's role may not see them.
#[derive(Clone, Debug, PartialEq)]
pub struct Blocker {
    pub pid: i32,
    /// `active`, `idle in transaction`, …; None for a prepared transaction.
    pub state: Option<String>,
    /// Its current or last statement's.
    pub query_id: Option<i64>,
    /// Its transaction's age and how long it has been in its state, in seconds.
    pub transaction_seconds: Option<f64>,
    pub state_seconds: Option<f64>,
    /// When its transaction began (Unix seconds): with the pid, which transaction it is.
    pub transaction_start: Option<f64>,
}

/// Every lock waiter (at most [`WAITERS_PER_POLL`]) with each session it waits for.
pub async fn poll(client: &Client) -> Result<Vec<BlockedPair>> {
    let rows = client
        .query(
            "SELECT w.pid, w.wait_event_type || ':' || w.wait_event, w.query_id, bp.pid, \
                    b.state, b.query_id, \
                    extract(epoch FROM now() - b.xact_start)::float8, \
                    extract(epoch FROM now() - b.state_change)::float8, \
                    extract(epoch FROM b.xact_start)::float8 \
             FROM (SELECT pid, wait_event_type, wait_event, query_id FROM pg_stat_activity \
                   WHERE wait_event_type = 'Lock' LIMIT $1) w \
             CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS bp(pid) \
             LEFT JOIN pg_stat_activity b ON b.pid = bp.pid",
            &[&WAITERS_PER_POLL],
        )
        .await
        .context("reading the lock waiters and who blocks them (pg_blocking_pids)")?;
    rows.iter()
        .map(|row| {
            Ok(BlockedPair {
                waiter: row.try_get(0)?,
                wait_event: row.try_get(1)?,
                waiter_query_id: row.try_get(2)?,
                blocker: Blocker {
                    pid: row.try_get(3)?,
                    state: row.try_get(4)?,
                    query_id: row.try_get(5)?,
                    transaction_seconds: row.try_get(6)?,
                    state_seconds: row.try_get(7)?,
                    transaction_start: row.try_get(8)?,
                },
            })
        })
        .collect::<Result<_, tokio_postgres::Error>>()
        .context("a row of the lock waiters")
}

/// One transaction that held up others over a trace, at the end of their chains.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LockBlocker {
    pub pid: i32,
    /// When its transaction began (Unix seconds), where pgscope's role may see it.
    pub transaction_start: Option<f64>,
    /// Its state at the last poll that saw it blocking; `prepared transaction` for pid 0.
    pub state: String,
    /// Polls that saw it blocking, and of those, the polls it was `idle in transaction`.
    pub polls: u32,
    pub idle_in_transaction_polls: u32,
    /// Its statement's queryid at the last poll (for a session idle in transaction, the last
    /// statement it ran).
    pub query_id: Option<i64>,
    /// Its transaction's age and its time in its state at the last poll, in seconds.
    pub transaction_seconds: Option<f64>,
    pub state_seconds: Option<f64>,
    /// The sessions it held up, by pid.
    pub waiters: BTreeMap<i32, HeldUp>,
    /// Sessions between it and some of its waiters: themselves waiting for a lock it holds,
    /// with others queued behind their request (a DDL statement's ACCESS EXCLUSIVE request, which
    /// every later lock on the table queues behind), by pid, with their wait event.
    #[serde(default)]
    pub queued_behind: BTreeMap<i32, String>,
}

impl LockBlocker {
    /// The waiters' time it cost, in seconds: each poll that saw a waiter behind it counts the
    /// time since the poll before.
    pub fn waiter_seconds(&self) -> f64 {
        self.waiters.values().map(|w| w.seconds).sum()
    }

    /// Whether it was idle in a transaction at most of the polls that saw it blocking.
    pub fn mostly_idle_in_transaction(&self) -> bool {
        2 * self.idle_in_transaction_polls > self.polls
    }
}

/// The sessions that blocked others over a measurement, and how it was polled.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BlockerEvidence {
    pub polls: u32,
    pub interval_seconds: f64,
    /// The most waiter time first.
    pub blockers: Vec<LockBlocker>,
}

/// A session held up by a blocker: the polls it was, its wait events and statements.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeldUp {
    pub polls: u32,
    /// The time since the previous poll, summed over the polls that saw it waiting.
    pub seconds: f64,
    pub wait_events: BTreeSet<String>,
    pub query_ids: BTreeSet<i64>,
}

/// The polls of a trace, folded by blocking session.
#[derive(Clone, Debug, Default)]
pub struct BlockerLog {
    /// Polls made, whatever they found, and the interval between them.
    pub polls: u32,
    pub interval_seconds: f64,
    /// By (pid, transaction start's bits): a session's each transaction apart.
    blockers: BTreeMap<(i32, u64), LockBlocker>,
}

impl BlockerLog {
    pub fn new(interval_seconds: f64) -> Self {
        Self {
            interval_seconds,
            ..Self::default()
        }
    }

    /// Adds one poll, `elapsed_seconds` after the one before: each waiter is charged to the
    /// ends of its chains (the blockers it reaches that wait on no lock themselves; in a cycle,
    /// a deadlock about to be broken, the sessions it waits for directly).
    pub fn record(&mut self, pairs: &[BlockedPair], elapsed_seconds: f64) {
        self.polls += 1;
        let mut waits_for: BTreeMap<i32, Vec<&Blocker>> = BTreeMap::new();
        let mut waiters: BTreeMap<i32, &BlockedPair> = BTreeMap::new();
        for pair in pairs {
            let blockers = waits_for.entry(pair.waiter).or_default();
            if !blockers.iter().any(|b| b.pid == pair.blocker.pid) {
                blockers.push(&pair.blocker);
            }
            waiters.entry(pair.waiter).or_insert(pair);
        }
        let mut blocking_now: BTreeSet<(i32, u64)> = BTreeSet::new();
        for (waiter, pair) in &waiters {
            let mut ends = chain_ends(*waiter, &waits_for);
            if ends.is_empty() {
                ends = waits_for[waiter].clone();
            }
            // The waiter's direct blockers that wait themselves: it queues behind their request.
            let between: Vec<(i32, String)> = waits_for[waiter]
                .iter()
                .filter_map(|b| waiters.get(&b.pid).map(|p| (b.pid, p.wait_event.clone())))
                .collect();
            for blocker in ends {
                self.charge(pair, blocker, elapsed_seconds, &mut blocking_now);
                let key = (blocker.pid, blocker.transaction_start.map_or(0, f64::to_bits));
                if let Some(entry) = self.blockers.get_mut(&key) {
                    entry
                        .queued_behind
                        .extend(between.iter().filter(|(pid, _)| *pid != blocker.pid).cloned());
                }
            }
        }
    }

    fn charge(
        &mut self,
        pair: &BlockedPair,
        blocker: &Blocker,
        elapsed_seconds: f64,
        blocking_now: &mut BTreeSet<(i32, u64)>,
    ) {
        let key = (blocker.pid, blocker.transaction_start.map_or(0, f64::to_bits));
        let entry = self.blockers.entry(key).or_insert_with(|| LockBlocker {
            pid: blocker.pid,
            transaction_start: blocker.transaction_start,
            state: String::new(),
            polls: 0,
            idle_in_transaction_polls: 0,
            query_id: None,
            transaction_seconds: None,
            state_seconds: None,
            waiters: BTreeMap::new(),
            queued_behind: BTreeMap::new(),
        });
        let held = entry.waiters.entry(pair.waiter).or_default();
        held.polls += 1;
        held.seconds += elapsed_seconds;
        held.wait_events.insert(pair.wait_event.clone());
        held.query_ids.extend(pair.waiter_query_id);
        if blocking_now.insert(key) {
            entry.polls += 1;
            let state = match (blocker.pid, &blocker.state) {
                (0, _) => "prepared transaction".to_string(),
                (_, Some(state)) => state.clone(),
                (_, None) => "not visible to pgscope's role".to_string(),
            };
            if state == "idle in transaction" {
                entry.idle_in_transaction_polls += 1;
            }
            entry.state = state;
            entry.query_id = blocker.query_id.or(entry.query_id);
            entry.transaction_seconds = blocker.transaction_seconds.or(entry.transaction_seconds);
            entry.state_seconds = blocker.state_seconds;
        }
    }

    /// What the polls found, for the findings, the JSON and a recording.
    pub fn evidence(&self) -> BlockerEvidence {
        BlockerEvidence {
            polls: self.polls,
            interval_seconds: self.interval_seconds,
            blockers: self.blockers(),
        }
    }

    /// The blocking sessions, the most waiter time first.
    pub fn blockers(&self) -> Vec<LockBlocker> {
        let mut blockers: Vec<LockBlocker> = self.blockers.values().cloned().collect();
        blockers.sort_by(|a, b| {
            b.waiter_seconds()
                .total_cmp(&a.waiter_seconds())
                .then(a.pid.cmp(&b.pid))
        });
        blockers
    }
}

/// The sessions at the ends of `waiter`'s chains: those it reaches through `waits_for` that
/// wait for no one themselves. Empty when every path loops.
fn chain_ends<'a>(waiter: i32, waits_for: &BTreeMap<i32, Vec<&'a Blocker>>) -> Vec<&'a Blocker> {
    let mut ends: Vec<&Blocker> = Vec::new();
    let mut seen = BTreeSet::from([waiter]);
    let mut stack: Vec<&Blocker> = waits_for.get(&waiter).cloned().unwrap_or_default();
    while let Some(blocker) = stack.pop() {
        if !seen.insert(blocker.pid) {
            continue;
        }
        match waits_for.get(&blocker.pid) {
            Some(next) if blocker.pid != 0 => stack.extend(next.iter().copied()),
            _ => ends.push(blocker),
        }
    }
    ends.sort_by_key(|b| b.pid);
    ends
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocker(pid: i32, state: &str) -> Blocker {
        Blocker {
            pid,
            state: Some(state.to_string()),
            query_id: Some(i64::from(pid) * 10),
            transaction_seconds: Some(30.0),
            state_seconds: Some(29.0),
            transaction_start: Some(1.8e9 + f64::from(pid)),
        }
    }

    fn pair(waiter: i32, event: &str, blocker: Blocker) -> BlockedPair {
        BlockedPair {
            waiter,
            wait_event: event.to_string(),
            waiter_query_id: Some(7),
            blocker,
        }
    }

    #[test]
    fn a_chain_is_charged_to_the_session_at_its_end() {
        // 3 waits for 2, which waits for 1 (idle in transaction); 4 waits for 1 directly.
        let poll = [
            pair(2, "Lock:transactionid", blocker(1, "idle in transaction")),
            pair(3, "Lock:tuple", blocker(2, "active")),
            pair(4, "Lock:transactionid", blocker(1, "idle in transaction")),
        ];
        let mut log = BlockerLog::new(0.5);
        log.record(&poll, 0.5);
        log.record(&poll, 0.5);
        log.record(&[], 0.5);
        let blockers = log.blockers();
        assert_eq!(blockers.len(), 1, "{blockers:?}");
        let root = &blockers[0];
        assert_eq!((root.pid, root.polls, root.idle_in_transaction_polls), (1, 2, 2));
        assert!(root.mostly_idle_in_transaction());
        assert_eq!(root.waiters.keys().copied().collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(
            root.waiters[&3].wait_events,
            BTreeSet::from(["Lock:tuple".to_string()])
        );
        assert!((root.waiter_seconds() - 3.0).abs() < 1e-9);
        assert_eq!(log.polls, 3);
    }

    #[test]
    fn sessions_queued_behind_a_waiting_request_say_whose_request() {
        // An ALTER (2) waits for a long transaction (1); readers (3, 4) queue behind the
        // ALTER's request.
        let poll = [
            pair(2, "Lock:relation", blocker(1, "active")),
            pair(3, "Lock:relation", blocker(2, "active")),
            pair(4, "Lock:relation", blocker(2, "active")),
        ];
        let mut log = BlockerLog::new(0.5);
        log.record(&poll, 0.5);
        let blockers = log.blockers();
        assert_eq!(blockers.len(), 1, "{blockers:?}");
        assert_eq!(blockers[0].pid, 1);
        assert_eq!(
            blockers[0].queued_behind,
            BTreeMap::from([(2, "Lock:relation".to_string())])
        );
    }

    #[test]
    fn a_deadlock_cycle_charges_the_sessions_waited_for_directly() {
        let poll = [
            pair(1, "Lock:transactionid", blocker(2, "active")),
            pair(2, "Lock:transactionid", blocker(1, "active")),
        ];
        let mut log = BlockerLog::new(1.0);
        log.record(&poll, 0.5);
        let pids: Vec<i32> = log.blockers().iter().map(|b| b.pid).collect();
        assert_eq!(pids, vec![1, 2]);
        assert!(log.blockers().iter().all(|b| b.waiter_seconds() == 0.5));
    }

    #[test]
    fn a_prepared_transaction_and_a_hidden_session_are_named_as_such() {
        let hidden = Blocker {
            state: None,
            ..blocker(9, "")
        };
        let prepared = Blocker {
            state: None,
            ..blocker(0, "")
        };
        let mut log = BlockerLog::new(1.0);
        log.record(
            &[
                pair(5, "Lock:transactionid", prepared),
                pair(6, "Lock:relation", hidden),
            ],
            1.0,
        );
        let states: Vec<(i32, String)> = log.blockers().into_iter().map(|b| (b.pid, b.state)).collect();
        assert_eq!(
            states,
            vec![
                (0, "prepared transaction".to_string()),
                (9, "not visible to pgscope's role".to_string())
            ]
        );
    }

    #[test]
    fn a_waiter_behind_two_holders_counts_once_for_each() {
        let mut log = BlockerLog::new(1.0);
        log.record(
            &[
                pair(5, "Lock:relation", blocker(1, "active")),
                pair(5, "Lock:relation", blocker(2, "idle in transaction")),
                pair(5, "Lock:relation", blocker(2, "idle in transaction")),
            ],
            1.0,
        );
        let blockers = log.blockers();
        assert_eq!(blockers.len(), 2);
        assert!(blockers.iter().all(|b| b.waiters[&5].polls == 1 && b.polls == 1));
    }

    #[test]
    fn each_transaction_of_a_session_is_its_own_blocker() {
        let mut log = BlockerLog::new(1.0);
        let first = blocker(1, "active");
        let second = Blocker {
            transaction_start: Some(2.0e9),
            ..blocker(1, "active")
        };
        log.record(&[pair(5, "Lock:tuple", first)], 1.0);
        log.record(&[pair(5, "Lock:tuple", second)], 1.0);
        let blockers = log.blockers();
        assert_eq!(blockers.len(), 2);
        assert!(blockers.iter().all(|b| b.pid == 1 && b.polls == 1));
    }
}
