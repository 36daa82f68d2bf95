//! pg_stat_statements' own cost: with fewer entries (`pg_stat_statements.max`) than the
//! distinct statements a workload runs, every new statement evicts others under the
//! extension's lock held exclusively, and every backend finishing a statement queues on it.

use super::{percent, Finding, Severity};
use crate::model::{PgssEvidence, WaitTables};

/// The wait event of pg_stat_statements' LWLock (its tranche, named by the extension).
const PGSS_LOCK: &str = "LWLock:pg_stat_statements";
/// Evictions per second from which the lock is taken exclusively often enough to matter.
const EVICTIONS_WARN: f64 = 1.0;
const EVICTIONS_CRITICAL: f64 = 10.0;
/// Share of the backends' time (on CPU and blocked) spent waiting on the extension's lock.
const LOCK_WARN: f64 = 0.05;
const LOCK_CRITICAL: f64 = 0.20;
/// Evictions in a window that pgscope's own reading can cause: its query of the counter is a
/// statement too, new to a full table once evicted, and its entry evicts others (one
/// `entry_dealloc`). Seen on an idle instance with a full table, as an information finding.
const OWN_EVICTIONS: i64 = 1;

/// Share of the backends' time (`backend_ns`: on CPU and blocked, the client's time left out)
/// spent waiting on pg_stat_statements' LWLock. Not a share of the blocked time alone: where
/// statements barely block, the lock's few waits at each new entry make a large part of a
/// little (6.7% of the blocked time, 0.8% of the time, on 128 statements with room for each).
fn lock_share(waits: &WaitTables, backend_ns: u64) -> Option<f64> {
    (backend_ns > 0).then(|| waits.blocked_in(PGSS_LOCK) as f64 / backend_ns as f64)
}

/// The eviction storm, from pg_stat_statements' counter and, with off-CPU time, the waits on
/// the extension's lock out of `backend_ns`, all the time the backends were busy.
pub fn evictions(pgss: Option<&PgssEvidence>, waits: Option<&WaitTables>, backend_ns: u64) -> Vec<Finding> {
    let share = waits.and_then(|waits| lock_share(waits, backend_ns));
    let rate = pgss.map(|p| p.evictions as f64 / p.seconds.max(1e-3));
    let evicting = pgss.is_some_and(|p| p.evictions > OWN_EVICTIONS);
    let by_rate = rate.filter(|_| evicting).map_or(Severity::Info, |r| match r {
        r if r >= EVICTIONS_CRITICAL => Severity::Critical,
        r if r >= EVICTIONS_WARN => Severity::Warning,
        _ => Severity::Info,
    });
    let by_lock = share.map_or(Severity::Info, |s| match s {
        s if s >= LOCK_CRITICAL => Severity::Critical,
        s if s >= LOCK_WARN => Severity::Warning,
        _ => Severity::Info,
    });
    // Evictions that cost the backends next to nothing of their time (measured off CPU) are
    // information, however often they happen: the contract of every finding.
    let severity = match share {
        Some(share) if share < super::NEGLIGIBLE_SHARE => Severity::Info,
        _ => by_rate.max(by_lock),
    };
    if !evicting && severity == Severity::Info {
        return Vec::new();
    }
    let mut numbers = Vec::new();
    if let (Some(p), Some(rate)) = (pgss, rate) {
        numbers.push((
            "evictions (pg_stat_statements_info.dealloc)".into(),
            format!("{} ({rate:.1}/s)", p.evictions),
        ));
        numbers.push(("pg_stat_statements.max".into(), p.max.to_string()));
    }
    if let Some(share) = share {
        numbers.push((format!("backends' time in {PGSS_LOCK}"), percent(share)));
    }
    let title = match (evicting, rate) {
        (true, Some(rate)) => format!(
            "pg_stat_statements evicts entries {rate:.1} times a second: the workload runs more distinct statements than its {} entries",
            pgss.map_or(0, |p| p.max)
        ),
        _ => format!(
            "backends wait on pg_stat_statements' lock for {} of their time",
            percent(share.unwrap_or(0.0))
        ),
    };
    vec![Finding {
        kind: "pgss_evictions",
        severity,
        title,
        numbers,
        query_ids: Vec::new(),
        frames: vec![
            "pgss_store".into(),
            "entry_dealloc".into(),
            "LWLockAcquire".into(),
        ],
        action: "raise pg_stat_statements.max above the number of distinct statements (a restart is \
                 needed); each eviction takes the extension's lock exclusively, and every backend \
                 finishing a statement queues behind it; fewer distinct statements (parameters \
                 instead of literals) help too"
            .into(),
        cause: None,
    }]
}

#[cfg(test)]
mod tests {
    use super::*;
    use exporters::{Frame, FrameKind, Profile, ProfileMeta, StackSample};
    use std::sync::Arc;

    fn wait(wait_event: &str, class: &str, ns: u64) -> StackSample {
        StackSample {
            frames: vec![Frame {
                name: Arc::from("futex (syscall)"),
                kind: FrameKind::Kernel,
                module: None,
            }],
            labels: vec![
                ("off_cpu".into(), class.into()),
                ("wait_event".into(), wait_event.into()),
            ],
            count: ns,
        }
    }

    /// `evictions` counted over `seconds` with `pg_stat_statements.max` = `max`.
    fn evidence(evictions: i64, max: i64, seconds: f64) -> PgssEvidence {
        PgssEvidence {
            evictions,
            max,
            seconds,
        }
    }

    fn off_cpu(samples: Vec<StackSample>) -> WaitTables {
        WaitTables::from_profile(&Profile {
            meta: ProfileMeta::off_cpu(0, 1),
            samples,
        })
    }

    #[test]
    fn an_eviction_storm_is_named_with_its_lock_waits_a_calm_instance_is_not() {
        let storm = evidence(5783, 100, 8.0);
        let waits = off_cpu(vec![
            wait(PGSS_LOCK, "futex", 2_000),
            wait("(no wait event)", "preempted", 8_000),
            // The client's time, in a transaction or idle: not the statements'.
            wait("Client:ClientRead", "latch", 80_000),
            wait("Client:ClientRead", "idle", 1_000_000),
        ]);
        // 2 µs on the lock of 10 µs busy (CPU + blocked): the client's time is not theirs.
        let found = evictions(Some(&storm), Some(&waits), 10_000);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(
            found[0].numbers.iter().any(|(_, v)| v == "20.0%"),
            "{:?}",
            found[0].numbers
        );

        let calm = evidence(0, 5000, 8.0);
        let quiet = off_cpu(vec![wait(PGSS_LOCK, "futex", 1), wait("IO:WALSync", "io", 8_000)]);
        assert!(evictions(Some(&calm), Some(&quiet), 20_000).is_empty());
        assert!(evictions(None, None, 20_000).is_empty());
        // Evictions at 10 a second whose waits are 0.1% of the backends' time: information.
        let cheap = off_cpu(vec![wait(PGSS_LOCK, "futex", 20)]);
        let found = evictions(Some(&evidence(80, 100, 8.0)), Some(&cheap), 20_000);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].severity, Severity::Info);
        // One eviction in a short window: pgscope's own query of the counter can cause it.
        let own = evidence(1, 100, 0.5);
        assert!(evictions(Some(&own), Some(&quiet), 20_000).is_empty());
    }

    #[test]
    fn lock_waits_alone_are_named_without_the_counter() {
        let waits = off_cpu(vec![
            wait(PGSS_LOCK, "futex", 1_000),
            wait("IO:DataFileRead", "io", 9_000),
        ]);
        let found = evictions(None, Some(&waits), 10_000);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].severity, Severity::Warning);
    }

    #[test]
    fn a_few_lock_waits_of_statements_that_barely_block_are_not_named() {
        // Every statement has its entry: the lock's waits are 6.7% of the little the
        // statements blocked, and under 1% of their time.
        let calm = evidence(0, 5000, 6.0);
        let waits = off_cpu(vec![
            wait(PGSS_LOCK, "futex", 71),
            wait("(no wait event)", "preempted", 984),
            wait("Client:ClientRead", "latch", 68_690),
        ]);
        let cpu = 8_110;
        assert!(evictions(Some(&calm), Some(&waits), cpu + 71 + 984).is_empty());
        // The same waits when the statements' time is mostly theirs: named.
        assert_eq!(evictions(Some(&calm), Some(&waits), 1_000).len(), 1);
    }
}
