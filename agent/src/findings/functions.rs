//! Probed functions that take most of a statement's time. A probe counts each call and times
//! it from entry to return; the statement's time is its on-CPU time (samples × period) plus
//! its off-CPU time without idle client waits. When one function takes most of it, that
//! function is the statement's cost, whatever the plan says — and each probed function is one
//! whose cost has a known mechanism.
//!
//! The function's share is read from the samples, counted as the statement's time is: of its
//! time on and off CPU, the part with the function on the stack. A probe's own time does not
//! compare with it: it includes part of the probe's own traps, which the statement's time
//! leaves out (on a VACUUM of a small table, ~5 µs of an 11 µs call: half the statement's time
//! "in" a function the samples put at a third). Without off-CPU time the statement's time is
//! its CPU time alone, and the share is of its on-CPU samples.

use std::collections::BTreeMap;

use exporters::Profile;

use super::{percent, Finding, Severity, StatementCause};
use crate::bpf::abi::Function;
use crate::model::statements::share_with_frame;
use crate::model::wall_clock::time_with_frame;
use crate::model::{ProbeRow, QueryId, StatementTime};

/// A function this share of a statement's time dominates it.
const DOMINANT: f64 = 0.50;
const CRITICAL: f64 = 0.80;
/// Calls needed before a per-call figure means anything.
const MIN_CALLS: u64 = 10;

/// What a probed function's time is, and what to consider when it dominates a statement.
fn mechanism(function: Function) -> Option<(&'static str, &'static str)> {
    Some(match function {
        // Probed by name: what the catalogue says of its subsystem, when it has one.
        Function::Named(_) => match crate::postgres::subsystems::of_frame(function.name(), None) {
            Some(subsystem) => (subsystem.what, subsystem.usual_causes),
            None => (
                "a function probed by name (--probes)",
                "compare its calls per execution with what the statement should need: a count \
                 that grows with the rows or the relations touched is the cost to remove",
            ),
        },
        Function::PgssStore => (
            "pg_stat_statements recording the statement (its entry's spinlock; a new entry, \
             and evictions when the table is full, under the extension's LWLock)",
            "compare the distinct statements with pg_stat_statements.max (evictions in \
             pg_stat_statements_info.dealloc); track_planning = on doubles the updates of each \
             entry; pg_stat_statements.track = top skips nested statements",
        ),
        Function::SLock => (
            "spinning on a spinlock another backend holds",
            "`--probes s_lock` names the call sites (file and line); fewer backends on the same \
             object at once (a pooler), or less work per call on it",
        ),
        Function::LockRelationOid => (
            "taking relation locks (beyond 16 per transaction through the shared lock table)",
            "a plan that references many relations or partitions locks them all: plan-time \
             pruning (custom plans, constants), fewer partitions, or fewer relations per query",
        ),
        Function::GetCachedPlan => (
            "getting its cached plan: revalidating and locking a generic plan, or planning a \
             custom one",
            "a generic plan locks all it references at every execution, a custom plan is \
             planned at every execution: try the other plan_cache_mode for this statement",
        ),
        Function::VacUpdateDatfrozenxid => (
            "VACUUM's scan of every pg_class row to advance the database's datfrozenxid, \
             which ends each VACUUM command",
            "with many relations, vacuum many tables per VACUUM command (one scan) rather than \
             one table per command, or reduce the number of relations",
        ),
        Function::BtGetroot => (
            "descending from a B-tree's root page, once per index scan",
            "many short index scans of the same index (the inner side of a nested loop) all \
             start at its root page: a hash join, or a scan of the small table instead",
        ),
        // PortalStart is a phase of every statement, which the phase rule speaks of.
        Function::PortalStart => return None,
    })
}

/// What a function's share of a statement is measured against.
#[derive(Clone, Copy)]
pub enum ShareOf<'a> {
    /// The statement's time on and off CPU (off-CPU time was measured).
    Time {
        on_cpu: &'a Profile,
        off_cpu: &'a Profile,
    },
    /// The statement's on-CPU samples (off-CPU time was not measured).
    CpuSamples(&'a Profile),
}

pub fn dominating(
    rows: &[ProbeRow],
    statement_time: &StatementTime,
    min_statement_ns: u64,
    share_of: ShareOf,
) -> Vec<Finding> {
    let mut per_call: BTreeMap<(QueryId, Function), (u64, u64)> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.query_id.is_statement()) {
        let entry = per_call.entry((row.query_id, row.function)).or_default();
        entry.0 += row.calls;
        entry.1 += row.total_ns;
    }
    let mut findings = Vec::new();
    for ((query_id, function), (calls, ns)) in per_call {
        let Some((what, action)) = mechanism(function) else {
            continue;
        };
        let Some(&statement_ns) = statement_time.get(&query_id) else {
            continue;
        };
        if calls < MIN_CALLS || statement_ns < min_statement_ns {
            continue;
        }
        let (share, of) = match share_of {
            ShareOf::Time { on_cpu, off_cpu } => {
                let with = time_with_frame(on_cpu, off_cpu, query_id, function.name());
                (with as f64 / statement_ns as f64, "time")
            }
            ShareOf::CpuSamples(profile) => {
                (share_with_frame(profile, query_id, function.name()), "CPU time")
            }
        };
        if share < DOMINANT {
            continue;
        }
        findings.push(Finding {
            kind: "function_dominance",
            severity: Severity::warning_or_critical(share, CRITICAL),
            title: format!(
                "queryid {query_id} spends {} of its {of} in {}",
                percent(share.min(1.0)),
                function.name()
            ),
            numbers: vec![
                (format!("{} calls", function.name()), calls.to_string()),
                (
                    "µs per call".into(),
                    format!("{:.1}", ns as f64 / calls as f64 / 1e3),
                ),
                (
                    format!("ms in {} calls, as probed", function.name()),
                    format!("{:.1}", ns as f64 / 1e6),
                ),
                (
                    match share_of {
                        ShareOf::Time { .. } => "ms of the statement (on CPU + blocked)".into(),
                        ShareOf::CpuSamples(_) => {
                            "ms of the statement on CPU (blocked time not measured)".into()
                        }
                    },
                    format!("{:.1}", statement_ns as f64 / 1e6),
                ),
                ("what it does".into(), what.into()),
            ],
            query_ids: vec![query_id],
            frames: vec![function.name().to_string()],
            action: action.into(),
            cause: Some(StatementCause {
                cause: format!("spend most of their {of} in {}", function.name()),
                figures: vec![format!("{} of its {of}", percent(share.min(1.0)))],
                cost_ns: (share.min(1.0) * statement_ns as f64) as u64,
            }),
        });
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{labelled, off_cpu, profile, sample};
    use crate::model::labels;
    use exporters::{Frame, FrameKind};
    use std::sync::Arc;

    fn row(query_id: i64, function: Function, calls: u64, total_ns: u64) -> ProbeRow {
        ProbeRow {
            query_id: QueryId(query_id),
            function,
            calls,
            total_ns,
            detail: 0,
        }
    }

    /// An off-CPU sample of `query_id` in `wait_event` (class `class`), weighing `ns`.
    fn blocked(
        query_id: &str,
        wait_event: &str,
        class: &str,
        frames: &[&str],
        ns: u64,
    ) -> exporters::StackSample {
        labelled(
            frames,
            &[
                (labels::QUERY_ID, query_id),
                (labels::WAIT_EVENT, wait_event),
                (labels::OFF_CPU, class),
            ],
            ns,
        )
    }

    /// Each queryid's time as the model counts it: on-CPU samples × period, off-CPU time
    /// without the client's, pgscope's probe traps left out.
    fn time_of(on_cpu: &Profile, off_cpu: &Profile) -> StatementTime {
        let statements = crate::model::statements::statements(on_cpu);
        crate::model::statement_time(&statements, on_cpu.meta.period, Some(off_cpu))
    }

    #[test]
    fn a_function_with_most_of_a_statements_time_is_named_one_with_little_is_not() {
        let on_cpu = profile(vec![
            sample(
                7,
                "run",
                &["vacuum", "vac_update_datfrozenxid", "heap_getnext"],
                90,
            ),
            sample(7, "run", &["vacuum"], 10),
            sample(8, "run", &["PortalStart", "LockRelationOid"], 3),
            sample(8, "run", &["PortalStart"], 97),
        ]);
        let none = off_cpu(Vec::new());
        let time = time_of(&on_cpu, &none);
        let rows = vec![
            row(7, Function::VacUpdateDatfrozenxid, 20, 900_000_000),
            row(8, Function::LockRelationOid, 3000, 30_000_000),
            // PortalStart is a phase, left to the phase rule.
            row(8, Function::PortalStart, 1000, 900_000_000),
        ];
        let share_of = ShareOf::Time {
            on_cpu: &on_cpu,
            off_cpu: &none,
        };
        let found = dominating(&rows, &time, 1, share_of);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].query_ids, vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        assert!(found[0]
            .title
            .contains("90.0% of its time in vac_update_datfrozenxid"));
    }

    #[test]
    fn time_blocked_under_the_function_counts_and_the_clients_does_not() {
        // pg_stat_statements' store: 20 ms on CPU in it, 60 ms blocked on its lock under it,
        // 20 ms on CPU elsewhere; the client's 900 ms is not the statement's.
        let on_cpu = profile(vec![
            sample(7, "run", &["ExecutorEnd", "pgss_store"], 2),
            sample(7, "run", &["ExecScan"], 2),
        ]);
        let period = on_cpu.meta.period;
        let waits = off_cpu(vec![
            blocked(
                "7",
                "LWLock:pg_stat_statements",
                "futex",
                &["pgss_store", "LWLockAcquire"],
                60 * period / 10,
            ),
            blocked("7", "Client:ClientRead", "latch", &["pq_getbyte"], 900_000_000),
        ]);
        let time = time_of(&on_cpu, &waits);
        let rows = vec![row(7, Function::PgssStore, 500, 1_000_000)];
        let found = dominating(
            &rows,
            &time,
            1,
            ShareOf::Time {
                on_cpu: &on_cpu,
                off_cpu: &waits,
            },
        );
        assert_eq!(found.len(), 1, "{found:?}");
        // (2 + 6) periods of 10: 80%, read from the stacks, not the calls' probed 1 ms.
        assert!(
            found[0].title.contains("80.0% of its time in pgss_store"),
            "{}",
            found[0].title
        );
    }

    #[test]
    fn a_probes_own_cost_in_short_calls_does_not_make_a_function_dominate() {
        // A VACUUM of a one-row table: half of each 11 µs call, as probed, is the probe's own
        // traps; the samples inside them are pgscope's and left out, and the samples put the
        // function at a third of the statement.
        let mut trap = sample(7, "run", &["vacuum", "vac_update_datfrozenxid"], 10);
        trap.frames.push(Frame {
            name: Arc::from("uprobe_notify_resume"),
            kind: FrameKind::Kernel,
            module: None,
        });
        let on_cpu = profile(vec![
            sample(
                7,
                "run",
                &["vacuum", "vac_update_datfrozenxid", "heap_getnext"],
                30,
            ),
            sample(7, "run", &["vacuum", "lazy_scan_heap"], 60),
            trap,
        ]);
        let none = off_cpu(Vec::new());
        let time = time_of(&on_cpu, &none);
        let statement_ns = time[&QueryId(7)];
        let rows = vec![row(
            7,
            Function::VacUpdateDatfrozenxid,
            50_000,
            statement_ns * 6 / 10,
        )];
        let share_of = ShareOf::Time {
            on_cpu: &on_cpu,
            off_cpu: &none,
        };
        assert!(
            dominating(&rows, &time, 1, share_of).is_empty(),
            "the calls' probed time (60%) named it against the samples' 33%"
        );
        assert!(
            dominating(&rows, &time, 1, ShareOf::CpuSamples(&on_cpu)).is_empty(),
            "the trap samples counted as the function's CPU"
        );
    }

    #[test]
    fn pgss_store_kinds_add_up_and_small_evidence_says_nothing() {
        let on_cpu = profile(vec![sample(7, "run", &["ExecutorEnd", "pgss_store"], 10)]);
        let none = off_cpu(Vec::new());
        let time = time_of(&on_cpu, &none);
        let share_of = ShareOf::Time {
            on_cpu: &on_cpu,
            off_cpu: &none,
        };
        // pgss_store(exec) and pgss_store(plan) come as two rows of one function.
        let rows = vec![
            row(7, Function::PgssStore, 500, 30_000_000),
            row(7, Function::PgssStore, 500, 30_000_000),
        ];
        assert_eq!(dominating(&rows, &time, 1, share_of).len(), 1);
        assert!(
            dominating(&rows, &time, 200_000_000, share_of).is_empty(),
            "too short a statement"
        );
        let few = vec![row(7, Function::PgssStore, 5, 90_000_000)];
        assert!(dominating(&few, &time, 1, share_of).is_empty(), "too few calls");
        let unknown = vec![row(0, Function::PgssStore, 500, 90_000_000)];
        assert!(dominating(
            &unknown,
            &StatementTime::from([(QueryId(0), 100_000_000)]),
            1,
            share_of
        )
        .is_empty());
    }

    #[test]
    fn without_blocked_time_the_share_comes_from_the_cpu_samples() {
        let time = StatementTime::from([(QueryId(7), 1_000_000_000)]);
        let rows = vec![row(7, Function::VacUpdateDatfrozenxid, 500, 900_000_000)];
        let small = profile(vec![
            sample(7, "executor", &["exec_simple_query", "vacuum"], 9),
            sample(7, "executor", &["vacuum", "vac_update_datfrozenxid"], 1),
        ]);
        assert!(
            dominating(&rows, &time, 1, ShareOf::CpuSamples(&small)).is_empty(),
            "named from wall time against CPU time"
        );
        let large = profile(vec![
            sample(7, "executor", &["vacuum"], 2),
            sample(
                7,
                "executor",
                &["vacuum", "vac_update_datfrozenxid", "heap_getnext"],
                8,
            ),
            sample(8, "executor", &["other"], 50),
        ]);
        let found = dominating(&rows, &time, 1, ShareOf::CpuSamples(&large));
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].title,
            "queryid 7 spends 80.0% of its CPU time in vac_update_datfrozenxid"
        );
    }
}
