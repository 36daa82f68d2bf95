//! What a wait event means and the first thing to check, in a DBA's words: the events that
//! incidents keep showing by name, and every wait event type for the rest. A statement's main
//! wait is then explained where it is named, whatever rule (or none) speaks of it.
//!
//! The names are `pg_stat_activity`'s (`wait_event_type:wait_event`) in PostgreSQL 14 to 18. An
//! SLRU cache shows under two: its `…SLRU` lock (the whole cache's control lock up to 16, its
//! banks' from 17) and its `…Buffer` locks (each page's I/O); both are listed. A name a major
//! lacks is never seen there.

/// A wait's meaning and what to look at first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitMeaning {
    /// What the backend waits for.
    pub what: &'static str,
    /// The first thing to check.
    pub check: &'static str,
}

const fn meaning(what: &'static str, check: &'static str) -> WaitMeaning {
    WaitMeaning { what, check }
}

/// Events by `type:name`.
const EVENTS: &[(&str, WaitMeaning)] = &[
    (
        "Lock:relation",
        meaning(
            "a lock on a table or index, usually DDL (ALTER TABLE, TRUNCATE, VACUUM FULL, REINDEX) \
             against the queries using it, or queries queued behind such a request",
            "pg_locks for the AccessExclusiveLock requested or held on the relation and \
             pg_blocking_pids() of the waiters; run DDL with lock_timeout",
        ),
    ),
    (
        "Lock:transactionid",
        meaning(
            "another transaction to end: it changed or locked a row this one wants to change",
            "the holder (pg_blocking_pids()): a row many sessions update at once, a long \
             transaction, or a session idle in its transaction",
        ),
    ),
    (
        "Lock:tuple",
        meaning(
            "its turn for a row other sessions are already waiting for",
            "the row's holder, as for Lock:transactionid: a hot row",
        ),
    ),
    (
        "Lock:extend",
        meaning(
            "the lock to add pages to a table or index file",
            "many sessions inserting into one table at once",
        ),
    ),
    (
        "Lock:advisory",
        meaning(
            "an advisory lock the application takes (pg_advisory_lock)",
            "the application's use of advisory locks: who holds the key (pg_locks, locktype advisory)",
        ),
    ),
    (
        "Lock:virtualxid",
        meaning(
            "other transactions to end, as CREATE INDEX CONCURRENTLY and some DDL wait for the \
             transactions older than them",
            "long-running transactions and sessions idle in their transactions (pg_stat_activity.xact_start)",
        ),
    ),
    (
        "LWLock:LockManager",
        meaning(
            "a partition of the shared lock table, used once a backend's 16 fast-path slots are \
             full",
            "statements that lock many relations (many partitions or indexes): pruning at plan \
             time, fewer partitions per statement",
        ),
    ),
    (
        "LWLock:BufferMapping",
        meaning(
            "the table mapping pages to shared buffers, taken to find a page or replace one",
            "a working set larger than shared_buffers: shared_blks_read against shared_blks_hit",
        ),
    ),
    (
        "LWLock:BufferContent",
        meaning(
            "a page that another backend is reading or changing",
            "hot pages: a small table many sessions update, an index's last page under ascending \
             inserts",
        ),
    ),
    (
        "LWLock:WALInsert",
        meaning(
            "a slot to copy its WAL records into the WAL buffers",
            "the WAL volume: wal_bytes and wal_fpi (full-page images after each checkpoint)",
        ),
    ),
    (
        "LWLock:WALWrite",
        meaning(
            "another backend writing or flushing WAL that this one's commit needs",
            "the commit rate and the WAL device's flush latency",
        ),
    ),
    (
        "LWLock:pg_stat_statements",
        meaning(
            "pg_stat_statements' shared hash table, taken exclusively to add or evict entries",
            "pg_stat_statements_info.dealloc: evictions mean pg_stat_statements.max is below the \
             number of distinct statements",
        ),
    ),
    (
        "LWLock:ProcArray",
        meaning(
            "the array of running transactions, to take a snapshot or end a transaction",
            "many connections and many short transactions: a connection pool",
        ),
    ),
    (
        "LWLock:SubtransSLRU",
        meaning(
            "the subtransaction cache (pg_subtrans), read when a snapshot has overflowed (a \
             transaction with more than 64 subtransactions open)",
            "savepoints or PL/pgSQL EXCEPTION blocks in a loop inside one transaction",
        ),
    ),
    (
        "LWLock:SubtransBuffer",
        meaning(
            "the subtransaction cache (pg_subtrans), read when a snapshot has overflowed (a \
             transaction with more than 64 subtransactions open)",
            "savepoints or PL/pgSQL EXCEPTION blocks in a loop inside one transaction",
        ),
    ),
    (
        "LWLock:MultiXactOffsetSLRU",
        meaning(
            "the multixact cache, read for rows several transactions lock at once (foreign-key \
             checks, SELECT FOR SHARE)",
            "many sessions locking the same referenced rows",
        ),
    ),
    (
        "LWLock:MultiXactOffsetBuffer",
        meaning(
            "the multixact cache, read for rows several transactions lock at once (foreign-key \
             checks, SELECT FOR SHARE)",
            "many sessions locking the same referenced rows",
        ),
    ),
    (
        "IO:DataFileRead",
        meaning(
            "a data page to be read from the kernel (its page cache or the disk)",
            "the statement's shared_blks_read: shared_buffers against the working set, or a plan \
             reading more pages than its rows need",
        ),
    ),
    (
        "IO:DataFileWrite",
        meaning(
            "its own write of a dirty page, to free a buffer",
            "writes by client backends in pg_stat_io (16+): the background writer and \
             checkpoints fall behind",
        ),
    ),
    (
        "IO:DataFileExtend",
        meaning(
            "the kernel adding pages to a table or index file",
            "bulk inserts into one table",
        ),
    ),
    (
        "IO:WALSync",
        meaning(
            "its commit's WAL to be flushed to disk (fsync)",
            "the commit rate and the WAL device's flush latency (pg_test_fsync); more work per \
             transaction",
        ),
    ),
    (
        "IO:WALWrite",
        meaning(
            "WAL to be written to the kernel",
            "the WAL volume (wal_bytes, wal_fpi) and the WAL device",
        ),
    ),
    (
        "IO:BufFileRead",
        meaning(
            "a temporary file to be read back: a sort, hash or materialization larger than work_mem",
            "the statement's temp_blks_written: work_mem (× hash_mem_multiplier for hashes)",
        ),
    ),
    (
        "IO:BufFileWrite",
        meaning(
            "a temporary file to be written: a sort, hash or materialization larger than work_mem",
            "the statement's temp_blks_written: work_mem (× hash_mem_multiplier for hashes)",
        ),
    ),
    (
        "IPC:SyncRep",
        meaning(
            "a synchronous standby to confirm the commit",
            "synchronous_standby_names and the standby's replay and network latency",
        ),
    ),
    (
        "Client:ClientRead",
        meaning(
            "the client's next message: between statements, or idle in a transaction",
            "the application's time between statements; a session idle in its transaction holds \
             its locks and snapshot meanwhile",
        ),
    ),
    (
        "Client:ClientWrite",
        meaning(
            "the client to read the results it was sent",
            "a slow client or network, or result sets larger than the application needs",
        ),
    ),
    (
        "Timeout:PgSleep",
        meaning(
            "pg_sleep(), called by the statement",
            "nothing: the statement asked for it",
        ),
    ),
    (
        "Timeout:VacuumDelay",
        meaning(
            "vacuum's cost-based delay",
            "vacuum_cost_limit and (autovacuum_)vacuum_cost_delay, where vacuum falls behind",
        ),
    ),
];

/// Wait event types, for the events [`EVENTS`] does not list.
const TYPES: &[(&str, WaitMeaning)] = &[
    (
        "Lock",
        meaning(
            "a heavyweight lock another transaction holds",
            "pg_locks and pg_blocking_pids() of the waiters",
        ),
    ),
    (
        "LWLock",
        meaning(
            "a lightweight lock on a shared-memory structure, which the event names",
            "more concurrent work on that structure than it scales to",
        ),
    ),
    (
        "BufferPin",
        meaning(
            "other backends to release their pin on a buffer (VACUUM's cleanup lock)",
            "long-running queries or open cursors on the table",
        ),
    ),
    (
        "IO",
        meaning(
            "a read, write or flush by the kernel",
            "the device's latency (iostat) and, from 16, pg_stat_io by kind of process and object",
        ),
    ),
    (
        "IPC",
        meaning(
            "another process of the instance (a parallel worker, a WAL sender, the checkpointer), \
             which the event names",
            "what that process is doing",
        ),
    ),
    (
        "Client",
        meaning(
            "the client",
            "the application's side: its time between statements, or its reading of results",
        ),
    ),
    (
        "Timeout",
        meaning(
            "a delay it sleeps on purpose",
            "the setting or call that asks for the delay",
        ),
    ),
    (
        "Activity",
        meaning(
            "work in a background process's main loop: idle",
            "nothing: a background process waiting for work",
        ),
    ),
    (
        "Extension",
        meaning("an extension's own wait", "the extension's documentation"),
    ),
];

/// What `wait` (`type:name`) means and what to check first, as a sentence: the catalogue's
/// words where [`EVENTS`] lists it; else PostgreSQL's own description of the event in the
/// server's major (generated into its names table: `pg_wait_events` on 17+, the documentation's
/// on 14-16) with its type's check; else its type's. None for what is no wait event.
pub fn explain(wait: &str, major: Option<u32>) -> Option<String> {
    if let Some((_, found)) = EVENTS.iter().find(|(name, _)| *name == wait) {
        return Some(format!(
            "{wait} is waiting for {}; first check {}",
            found.what, found.check
        ));
    }
    let (kind, event) = wait.split_once(':')?;
    let by_type = meaning_of(wait)?;
    let described = major
        .and_then(|major| super::table_for(major).ok())
        .and_then(|table| (table.wait_event_description)(kind, event));
    Some(match described {
        Some(description) => format!(
            "{wait}: {description} (PostgreSQL's description); first check {}",
            by_type.check
        ),
        None => format!(
            "{wait} is waiting for {}; first check {}",
            by_type.what, by_type.check
        ),
    })
}

/// The meaning of `wait` (`type:name`, as pgscope labels waits), by its event where
/// [`EVENTS`] lists it, else by its type; None for what is no wait event.
pub fn meaning_of(wait: &str) -> Option<WaitMeaning> {
    if let Some((_, found)) = EVENTS.iter().find(|(name, _)| *name == wait) {
        return Some(*found);
    }
    let kind = wait.split_once(':')?.0;
    TYPES.iter().find(|(name, _)| *name == kind).map(|(_, m)| *m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_explained_by_name_then_by_type() {
        assert!(meaning_of("Lock:transactionid")
            .unwrap()
            .what
            .contains("another transaction to end"));
        assert!(meaning_of("LWLock:WALInsert").unwrap().check.contains("wal_fpi"));
        // An event not listed: its type's.
        assert_eq!(meaning_of("IPC:ParallelFinish"), Some(TYPES[4].1));
        assert_eq!(meaning_of("(no wait event)"), None);
        assert_eq!(meaning_of("Nonsense:event"), None);
    }

    #[test]
    fn an_event_the_catalogue_does_not_list_takes_postgres_own_words_for_its_major() {
        // 17 describes its events in pg_wait_events; 15 has no such view, its documentation does.
        let on_17 = explain("IPC:ParallelFinish", Some(17)).unwrap();
        assert!(
            on_17.starts_with("IPC:ParallelFinish: Waiting for parallel workers to finish computing"),
            "{on_17}"
        );
        assert!(
            on_17.ends_with("first check what that process is doing"),
            "{on_17}"
        );
        let on_15 = explain("IPC:ParallelFinish", Some(15)).unwrap();
        assert!(
            on_15.starts_with("IPC:ParallelFinish: Waiting for parallel workers to finish computing."),
            "{on_15}"
        );
        // An event its major's tables do not describe: its type's words.
        let unknown = explain("IPC:NoSuchEvent", Some(15)).unwrap();
        assert!(
            unknown.starts_with("IPC:NoSuchEvent is waiting for another process"),
            "{unknown}"
        );
        // No major known: its type's words.
        assert!(explain("IPC:ParallelFinish", None)
            .unwrap()
            .starts_with("IPC:ParallelFinish is waiting for another process"));
        // The catalogue's words come first, whatever the major.
        assert!(explain("IO:WALSync", Some(17))
            .unwrap()
            .starts_with("IO:WALSync is waiting for its commit's WAL"));
        assert_eq!(explain("(no wait event)", Some(17)), None);
    }

    #[test]
    fn every_listed_event_has_a_known_type_and_is_listed_once() {
        for (i, (name, _)) in EVENTS.iter().enumerate() {
            let (kind, event) = name.split_once(':').expect(name);
            assert!(!event.is_empty());
            assert!(TYPES.iter().any(|(t, _)| *t == kind), "{name}");
            assert!(EVENTS[i + 1..].iter().all(|(other, _)| other != name), "{name}");
        }
    }

    /// Every listed event is one some supported major's pg_stat_activity shows: the generated
    /// names tables hold it.
    #[test]
    fn every_listed_event_is_named_by_a_supported_major() {
        let tables = [
            include_str!("v14/names.rs"),
            include_str!("v15/names.rs"),
            include_str!("v16/names.rs"),
            include_str!("v17/names.rs"),
            include_str!("v18/names.rs"),
        ];
        for (name, _) in EVENTS {
            let event = name.split_once(':').map(|(_, e)| e).unwrap();
            assert!(
                tables.iter().any(|table| table.contains(&format!("\"{event}\""))),
                "{name} is in no major's names table"
            );
        }
    }
}
