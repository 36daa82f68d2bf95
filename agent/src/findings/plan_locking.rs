//! Cached generic plans that spend the statement's time locking relations: `GetCachedPlan`
//! locks every relation a generic plan references before run-time pruning, every partition of
//! a partitioned table included. Beyond 16 locks a backend's fast path is full, and each lock
//! goes through the shared lock table under its partition's LWLock: backends running such a
//! plan at once wait on `LWLock:LockManager`, a cost of the same cause that CPU samples miss.

use super::cpu::statements;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::wall_clock::{total_of, waited_in};
use crate::model::{StatementCpu, StatementWall};

/// Locking relations inside GetCachedPlan (on CPU, and waiting on the lock manager's LWLocks)
/// at least this share of a statement's CPU or time.
const PLAN_LOCKS_WARN: f64 = 0.20;
const PLAN_LOCKS_CRITICAL: f64 = 0.50;
/// The wait of a backend queueing for a partition of the shared lock table.
const LOCK_MANAGER_WAIT: &str = "LWLock:LockManager";

/// The statements of `queries` whose cached plan's locking holds [`PLAN_LOCKS_WARN`] of their
/// CPU, or with their waits on the lock manager (`walls`, where off-CPU time was measured) of
/// their time.
pub fn generic_plan_locking(
    queries: &[StatementCpu],
    walls: &[StatementWall],
    period_ns: u64,
) -> Vec<Finding> {
    statements(queries)
        .filter(|q| q.plan_locking > 0)
        .filter_map(|q| {
            let cpu_share = q.plan_locking as f64 / q.samples as f64;
            let cpu_ns = q.plan_locking * period_ns;
            let waited = waited_in(walls, q.query_id, &[LOCK_MANAGER_WAIT]);
            let wall = total_of(walls, q.query_id);
            let time_share = wall.map(|total| (cpu_ns + waited) as f64 / total as f64);
            let share = time_share.unwrap_or(0.0).max(cpu_share);
            if share < PLAN_LOCKS_WARN {
                return None;
            }
            let mut numbers = vec![(
                "LockRelationOid under GetCachedPlan, of its CPU".into(),
                percent(cpu_share),
            )];
            if waited > 0 {
                numbers.push((
                    format!("waiting on {LOCK_MANAGER_WAIT}"),
                    format!("{:.1} ms", waited as f64 / 1e6),
                ));
            }
            if let Some(time_share) = time_share {
                numbers.push(("locking and its waits, of its time".into(), percent(time_share)));
            }
            numbers.push(("samples".into(), q.samples.to_string()));
            let figure = match time_share {
                Some(time_share) if waited > 0 => format!(
                    "{} of its time ({} of its CPU, and {:.1} ms waiting on {LOCK_MANAGER_WAIT})",
                    percent(time_share),
                    percent(cpu_share),
                    waited as f64 / 1e6
                ),
                _ => format!("{} of its CPU", percent(cpu_share)),
            };
            Some(Finding {
                kind: "generic_plan_locking",
                severity: Severity::warning_or_critical(share, PLAN_LOCKS_CRITICAL),
                title: format!(
                    "queryid {} spends {figure} locking relations for its cached plan",
                    q.query_id
                ),
                numbers,
                query_ids: vec![q.query_id],
                frames: vec!["GetCachedPlan".into(), "LockRelationOid".into()],
                action: "a generic plan locks every relation it may touch before pruning, all partitions \
                         included: plan_cache_mode = force_custom_plan for this statement plans each \
                         execution and locks only what the plan keeps; fewer partitions help too \
                         (`--probes LockRelationOid,GetCachedPlan` counts the locks per execution)"
                    .into(),
                cause: Some(StatementCause {
                    cause: "spend most of their time locking relations for their cached plans".into(),
                    figures: vec![figure],
                    cost_ns: cpu_ns + waited,
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
    use crate::model::QueryId;

    fn statement(query_id: i64, plan_locking: u64) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(query_id),
            samples: 100,
            plan_locking,
            ..StatementCpu::default()
        }
    }

    #[test]
    fn plan_locking_is_named_from_its_share_of_the_statement() {
        let found = generic_plan_locking(&[statement(7, 60), statement(8, 10), statement(0, 90)], &[], 1);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
    }

    #[test]
    fn the_lock_managers_waits_it_causes_count_in_its_time_and_cost() {
        // 10% of its CPU locking (10 ms of 100 ms), and 300 ms of its 600 ms waiting on the
        // lock manager: the statement's time goes to the cause its CPU only hints at.
        let period_ns = 1_000_000;
        let walls = [StatementWall {
            query_id: QueryId(8),
            total_ns: 600_000_000,
            parts: vec![
                WallPart {
                    name: LOCK_MANAGER_WAIT.into(),
                    ns: 300_000_000,
                },
                WallPart {
                    name: CPU.into(),
                    ns: 100_000_000,
                },
                WallPart {
                    name: "IO:DataFileRead".into(),
                    ns: 200_000_000,
                },
            ],
        }];
        let found = generic_plan_locking(&[statement(8, 10)], &walls, period_ns);
        assert_eq!(named(&found), vec![QueryId(8)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(
            found[0]
                .title
                .contains("51.7% of its time (10.0% of its CPU, and 300.0 ms waiting on LWLock:LockManager)"),
            "{}",
            found[0].title
        );
        assert_eq!(found[0].cause.as_ref().map(|c| c.cost_ns), Some(310_000_000));
        // Without off-CPU time, its CPU alone: 10% is not enough.
        assert!(generic_plan_locking(&[statement(8, 10)], &[], period_ns).is_empty());
    }
}
