//! The statements that wait the most, always reported beside the top CPU consumers: blocked
//! time (off CPU) per queryid, with the wait event most of it was spent in. Waits for the
//! client are left out — idle ones, and `Client:*` waits inside a transaction too: they are
//! the client's think time and round trips (the transaction's previous statement keeps its
//! queryid meanwhile), not time the statement spent in the database. So are sleeps asked for
//! (`pg_sleep`, vacuum's cost delay) and run-queue delay (`preempted`: the host's CPUs, not the
//! database; reported once for the whole trace by [`host_cpu_contention`]).

use super::{percent, Finding, Severity};
use crate::bpf::abi::OffCpuClass;
use crate::model::labels::is_deliberate_sleep;
use crate::model::waits::{QueryWait, QueryWaits};
use crate::model::{QueryId, StatementWall, WaitTables};
use crate::postgres::wait_events;

/// Statements named, at most, and the share of all waiting a statement needs to be named.
const TOP: usize = 3;
const TOP_MIN_SHARE: f64 = 0.01;

/// `walls`: each statement's wall-clock split (on- and off-CPU samples of one weight), which
/// says what share of the statement's own time its main wait took.
/// `major` is the traced server's, whose own descriptions of its wait events explain those the
/// catalogue does not list.
pub fn top_waiters(waits: Option<&WaitTables>, walls: &[StatementWall], major: Option<u32>) -> Vec<Finding> {
    let Some(waits) = waits else {
        return Vec::new();
    };
    let total = waits.blocked_ns() - waits.preempted_ns();
    if total == 0 {
        return Vec::new();
    }
    let mut queries: Vec<_> = waits
        .by_query
        .iter()
        .filter(|query| query.query_id.is_statement())
        .map(|query| (query, waiting_on_something(query).map(|w| w.ns).sum::<u64>()))
        .collect();
    queries.sort_by_key(|(query, ns)| (std::cmp::Reverse(*ns), query.query_id));
    queries
        .into_iter()
        .filter(|(_, ns)| *ns as f64 / total as f64 >= TOP_MIN_SHARE)
        .take(TOP)
        .map(|(query, ns)| {
            let share = ns as f64 / total as f64;
            let mut numbers = vec![
                ("share of the blocked time".to_string(), percent(share)),
                ("ms blocked".to_string(), format!("{:.1}", ns as f64 / 1e6)),
            ];
            // Longest first, equal ones in (wait event, class) order.
            let main = waiting_on_something(query).next();
            if let Some(main) = main {
                numbers.push((
                    format!("in {} ({})", main.wait, main.class),
                    percent(main.ns as f64 / ns as f64),
                ));
            }
            let wall = walls.iter().find(|w| w.query_id == query.query_id);
            let mut title = format!(
                "queryid {} accounts for {} of the time statements were blocked",
                query.query_id,
                percent(share)
            );
            if let Some(wall) = wall {
                numbers.push(("its time".to_string(), wall.render()));
                // Its main wait as a share of everything the statement did, CPU included:
                // "spends 41% of its time waiting on LWLock:pg_stat_statements".
                if let Some(part) = wall.parts.iter().find(|p| {
                    p.name != crate::model::wall_clock::CPU
                        && p.name != OffCpuClass::Preempted.name()
                        && !is_deliberate_sleep(Some(&p.name))
                }) {
                    title.push_str(&format!(
                        "; it spends {} of its time waiting on {}",
                        percent(wall.pct(part.ns) / 100.0),
                        part.name
                    ));
                }
            }
            Finding {
                kind: "top_wait",
                severity: Severity::Info,
                title,
                numbers,
                query_ids: vec![query.query_id],
                frames: Vec::new(),
                action: match main.and_then(|m| wait_events::explain(&m.wait, major)) {
                    Some(meaning) => format!(
                        "{meaning}. The off-CPU flamegraph filtered on this queryid shows where it \
                         waits"
                    ),
                    None => "the off-CPU flamegraph filtered on this queryid shows where it waits; \
                             the wait event names what it waited for (a lock, I/O, …)"
                        .into(),
                },
                cause: None,
            }
        })
        .collect()
}

/// A statement's waits on something: blocked time without run-queue delay, longest first.
fn waiting_on_something(query: &QueryWaits) -> impl Iterator<Item = &QueryWait> {
    query.blocked().filter(|w| !w.is_preempted())
}

/// Below this share of the backends' time spent runnable and waiting for a CPU, the host's
/// CPU contention is not reported.
const CONTENTION_MIN_SHARE: f64 = 0.05;
/// Statements named as those that waited most for a CPU.
const CONTENTION_TOP: usize = 3;

/// Host CPU contention, once for the whole measurement: the share of the backends' time
/// (`backend_ns`: on CPU and blocked) they spent runnable with no CPU to run on, with the
/// statements that waited most for one. Information: the host's CPUs (other work on it, more
/// active backends than cores), not the database, are the cause, and the statements' own
/// findings leave that time out of their waits.
pub fn host_cpu_contention(waits: Option<&WaitTables>, backend_ns: u64) -> Option<Finding> {
    let waits = waits?;
    let preempted = waits.preempted_ns();
    let share = preempted as f64 / backend_ns.max(1) as f64;
    if share < CONTENTION_MIN_SHARE {
        return None;
    }
    let mut by_query: Vec<(QueryId, u64)> = waits
        .by_query
        .iter()
        .filter(|q| q.query_id.is_statement())
        .map(|q| {
            let ns = q.blocked().filter(|w| w.is_preempted()).map(|w| w.ns).sum();
            (q.query_id, ns)
        })
        .filter(|(_, ns)| *ns > 0)
        .collect();
    by_query.sort_by_key(|(query_id, ns)| (std::cmp::Reverse(*ns), *query_id));
    by_query.truncate(CONTENTION_TOP);
    Some(Finding {
        kind: "cpu_contention",
        severity: Severity::Info,
        title: format!(
            "backends spent {} of their time runnable, waiting for a CPU the host did not have",
            percent(share)
        ),
        numbers: vec![
            (
                "ms runnable without a CPU (preempted)".to_string(),
                format!("{:.1}", preempted as f64 / 1e6),
            ),
            ("share of the backends' time".to_string(), percent(share)),
        ],
        query_ids: by_query.iter().map(|(query_id, _)| *query_id).collect(),
        frames: Vec::new(),
        action: "the host's CPUs are the bottleneck, not a lock or I/O: see what else runs on it \
                 (top, the host's CPU steal), and whether more backends are active at once than \
                 it has cores (a connection pooler limits them)"
            .into(),
        cause: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::tests::named;
    use crate::model::fixtures::{labelled, off_cpu};
    use crate::model::wall_clock::statement_walls;
    use crate::model::QueryId;

    fn wait(query_id: i64, wait_event: &str, class: &str, ns: u64) -> exporters::StackSample {
        let query_id = query_id.to_string();
        let labels = [
            ("off_cpu", class),
            ("queryid", &query_id),
            ("wait_event", wait_event),
        ];
        labelled(&[], &labels, ns)
    }

    #[test]
    fn the_longest_waiters_are_named_with_their_main_wait_and_idle_time_is_not_waiting() {
        let profile = off_cpu(vec![
            wait(7, "LWLock:pg_stat_statements", "futex", 600),
            wait(7, "IO:WALSync", "io", 100),
            wait(8, "Lock:transactionid", "latch", 300),
            // Client time, idle or in a transaction, is the client's, not the statement's.
            wait(9, "Client:ClientRead", "idle", 100_000),
            wait(9, "Client:ClientRead", "latch", 100_000),
            wait(0, "IO:DataFileRead", "io", 5),
        ]);
        let found = top_waiters(Some(&WaitTables::from_profile(&profile)), &[], None);
        assert_eq!(named(&found), vec![QueryId(7), QueryId(8)]);
        assert!(found[0]
            .numbers
            .iter()
            .any(|(k, v)| k == "in LWLock:pg_stat_statements (futex)" && v == "85.7%"));
        // Each main wait is explained from the catalogue of wait events.
        assert!(
            found[0].action.starts_with(
                "LWLock:pg_stat_statements is waiting for pg_stat_statements' shared hash table"
            ),
            "{}",
            found[0].action
        );
        assert!(found[1]
            .action
            .contains("first check the holder (pg_blocking_pids())"));
        assert!(top_waiters(None, &[], None).is_empty());
    }

    #[test]
    fn a_waiter_is_told_what_share_of_its_own_time_its_main_wait_takes() {
        use crate::model::fixtures::{profile, sample};
        let on_cpu = profile(vec![sample(7, "run", &["ExecScan"], 38)]);
        let period = on_cpu.meta.period;
        let off = off_cpu(vec![
            wait(7, "LWLock:pg_stat_statements", "futex", 41 * period),
            wait(7, "IO:DataFileRead", "io", 12 * period),
            wait(7, "Client:ClientRead", "idle", 900 * period),
        ]);
        let statements = crate::model::statements::statements(&on_cpu);
        let walls = statement_walls(&statements, period, &off);
        let found = top_waiters(Some(&WaitTables::from_profile(&off)), &walls, None);
        assert!(
            found[0]
                .title
                .ends_with("it spends 45.1% of its time waiting on LWLock:pg_stat_statements"),
            "{}",
            found[0].title
        );
        assert!(found[0]
            .numbers
            .iter()
            .any(|(k, v)| k == "its time"
                && v == "LWLock:pg_stat_statements 45% · CPU 42% · IO:DataFileRead 13%"));
        // Run-queue delay is not a wait on something: the host's CPUs, reported once.
        let preempted = labelled(&["x"], &[("off_cpu", "preempted"), ("queryid", "7")], 41 * period);
        let off = off_cpu(vec![preempted]);
        let walls = statement_walls(&statements, period, &off);
        let tables = WaitTables::from_profile(&off);
        assert!(top_waiters(Some(&tables), &walls, None).is_empty());
        let contention = host_cpu_contention(Some(&tables), 79 * period).expect("a contention finding");
        assert_eq!(contention.severity, Severity::Info);
        assert_eq!(contention.query_ids, vec![QueryId(7)]);
        assert!(
            contention
                .title
                .starts_with("backends spent 51.9% of their time runnable, waiting for a CPU"),
            "{}",
            contention.title
        );
        // Under 5% of the backends' time: not reported.
        assert!(host_cpu_contention(Some(&tables), 1000 * period).is_none());
    }

    #[test]
    fn a_sleep_asked_for_is_not_time_blocked() {
        let profile = off_cpu(vec![
            wait(7, "Timeout:PgSleep", "latch", 900),
            wait(8, "Lock:transactionid", "latch", 300),
            wait(9, "Timeout:SpinDelay", "latch", 200),
        ]);
        let tables = WaitTables::from_profile(&profile);
        assert_eq!(tables.blocked_ns(), 500);
        let found = top_waiters(Some(&tables), &[], None);
        assert_eq!(named(&found), vec![QueryId(8), QueryId(9)]);
    }
}
