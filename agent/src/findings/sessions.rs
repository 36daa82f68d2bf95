//! The instance's CPU spent opening and closing sessions. Every connection costs Postgres a
//! fork of the postmaster, a backend that authenticates its client and fills its catalog
//! caches from nothing, and an exit; an application that connects per request or per
//! transaction pays that each time, in processes no statement's queryid covers (the work runs
//! before the first statement and after the last). pg_stat_database's `sessions` (14+) confirms
//! it: sessions opened by the hundred each second. (Not sessions per transaction: each
//! extended-protocol message batch of a new session, a Parse before its first Execute, counts
//! as a transaction, so a session per transaction shows as a third of one.)

use exporters::{FrameKind, Profile, StackSample};

use super::cpu::supported_share;
use super::{percent, Finding, Severity};
use crate::model::labels;
use crate::postgres::sql::InstanceFacts;
use crate::postgres::subsystems::SESSIONS;

/// Starting and ending sessions this share of the instance's CPU: a quarter of it spent on
/// work a kept connection does not repeat. Half is critical.
const SESSIONS_WARN: f64 = 0.25;
const SESSIONS_CRITICAL: f64 = 0.50;
/// The share the samples must support with 95% confidence.
const SESSIONS_SUPPORTED: f64 = 0.15;
/// Fewer samples than this say nothing of the instance (the statements' rules ask as many).
const MIN_SAMPLES: u64 = 20;

/// The finding, where [`SESSIONS_WARN`] of the instance's CPU samples (`on_cpu`, every process
/// of it) are client sessions' starts and ends (a frame of the session family); with
/// pg_stat_database's sessions over the trace where they were read (`instance`).
pub fn connection_churn(on_cpu: &Profile, instance: Option<&InstanceFacts>, seconds: f64) -> Option<Finding> {
    let total = on_cpu.total_count();
    // The family's frames of each counted sample: what the finding cites (it is about no
    // statement, so `citations` has none to judge it against).
    let mut cited: Vec<&str> = Vec::new();
    let mut in_sessions = 0;
    for sample in on_cpu.samples.iter().filter(|s| of_client_sessions(s)) {
        let mut counted = false;
        for frame in sample
            .frames
            .iter()
            .filter(|f| f.kind == FrameKind::User && SESSIONS.holds(&f.name, f.module.as_deref()))
        {
            counted = true;
            if !cited.contains(&&*frame.name) {
                cited.push(&frame.name);
            }
        }
        if counted {
            in_sessions += sample.count;
        }
    }
    if total < MIN_SAMPLES {
        return None;
    }
    let share = in_sessions as f64 / total as f64;
    if share < SESSIONS_WARN || supported_share(in_sessions, total) < SESSIONS_SUPPORTED {
        return None;
    }
    let mut numbers = vec![
        (format!("CPU {}", SESSIONS.what), percent(share)),
        ("samples".into(), format!("{in_sessions} of {total}")),
    ];
    let mut title = format!(
        "{} of the instance's CPU goes to starting and ending sessions",
        percent(share)
    );
    if let Some(sessions) = instance.and_then(sessions_opened) {
        let per_second = if seconds > 0.0 { sessions / seconds } else { 0.0 };
        title.push_str(&format!(
            ": {sessions:.0} sessions opened over the trace, {per_second:.0} a second"
        ));
        numbers.push((
            "sessions opened (pg_stat_database)".into(),
            format!("{sessions:.0}, {per_second:.1} a second"),
        ));
    }
    Some(Finding {
        kind: "connection_churn",
        severity: Severity::warning_or_critical(share, SESSIONS_CRITICAL),
        title,
        numbers,
        query_ids: Vec::new(),
        // Only those sampled, in the family's order.
        frames: SESSIONS
            .functions
            .iter()
            .filter(|f| cited.contains(f))
            .map(|f| f.to_string())
            .collect(),
        action: "each new connection forks a backend that authenticates its client and fills its \
                 catalog caches from nothing, and each disconnection tears it down: an \
                 application that connects per request or per transaction pays this every time. \
                 Keep connections open and reuse them: the application's connection pool, or a \
                 pooler in front of Postgres (PgBouncer in transaction mode); pg_stat_database's \
                 sessions counts the sessions opened"
            .into(),
        cause: None,
    })
}

/// Whether `sample` is of a process that serves client connections: a client backend, a
/// process before it knows its type (a backend authenticating), or the postmaster forking
/// them. Not a parallel worker, an autovacuum worker or another background process, whose
/// start goes through the same `InitPostgres`: a pooler does not spare those, and their cost
/// has other causes (short parallel queries, many small tables to vacuum). A sample without
/// the label (a major pgscope cannot decode) counts.
fn of_client_sessions(sample: &StackSample) -> bool {
    sample
        .label(labels::BACKEND_TYPE)
        .is_none_or(|kind| matches!(kind, "client backend" | "not initialized" | "postmaster"))
}

/// pg_stat_database's sessions over the trace, summed over the databases; None before
/// PostgreSQL 14, which does not count them.
fn sessions_opened(instance: &InstanceFacts) -> Option<f64> {
    instance
        .database_deltas
        .values()
        .map(|row| row.get("sessions").copied())
        .sum()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::model::fixtures::{labelled, profile};

    /// A sample of no statement (a session's setup runs before its first).
    fn sample(functions: &[&str], count: u64) -> exporters::StackSample {
        labelled(functions, &[], count)
    }

    fn facts(sessions: Option<f64>, commits: f64) -> InstanceFacts {
        let mut row = BTreeMap::from([("xact_commit".to_string(), commits)]);
        if let Some(sessions) = sessions {
            row.insert("sessions".into(), sessions);
        }
        InstanceFacts {
            database_deltas: BTreeMap::from([("app".to_string(), row)]),
            ..InstanceFacts::default()
        }
    }

    #[test]
    fn sessions_started_per_transaction_are_named_with_postgres_counts() {
        let on_cpu = profile(vec![
            sample(&["main", "PostmasterMain", "fork_process"], 30),
            sample(
                &[
                    "main",
                    "PostgresMain",
                    "InitPostgres",
                    "RelationCacheInitializePhase3",
                ],
                60,
            ),
            sample(&["main", "PostgresMain", "exec_simple_query"], 50),
            sample(&["main", "PostgresMain", "proc_exit"], 20),
        ]);
        let found = connection_churn(&on_cpu, Some(&facts(Some(900.0), 1000.0)), 3.0).unwrap();
        assert_eq!(found.kind, "connection_churn");
        assert_eq!(found.severity, Severity::Critical, "{}", found.title);
        assert!(
            found.title.starts_with("68.8% of the instance's CPU"),
            "{}",
            found.title
        );
        assert!(found
            .title
            .contains("900 sessions opened over the trace, 300 a second"));
        assert!(found.numbers.contains(&(
            "sessions opened (pg_stat_database)".into(),
            "900, 300.0 a second".into()
        )));
        assert!(found.query_ids.is_empty());
        // It cites the functions sampled, none it did not see.
        assert_eq!(found.frames, vec!["fork_process", "InitPostgres", "proc_exit"]);
    }

    #[test]
    fn kept_connections_and_an_old_major_say_what_they_can() {
        // A long session's statements: PostgresMain is what every session runs under.
        let pooled = profile(vec![
            sample(&["main", "PostgresMain", "exec_simple_query"], 190),
            sample(&["main", "PostgresMain", "InitPostgres"], 10),
        ]);
        assert_eq!(
            connection_churn(&pooled, Some(&facts(Some(2.0), 5000.0)), 3.0),
            None
        );
        // PostgreSQL 13 counts no sessions: the share alone.
        let churn = profile(vec![
            sample(&["InitPostgres"], 40),
            sample(&["exec_simple_query"], 60),
        ]);
        let found = connection_churn(&churn, Some(&facts(None, 100.0)), 3.0).unwrap();
        assert_eq!(found.severity, Severity::Warning);
        assert!(!found
            .numbers
            .iter()
            .any(|(label, _)| label.starts_with("sessions")));
    }

    #[test]
    fn background_processes_starting_are_not_client_sessions() {
        // Parallel workers started for short parallel queries: InitPostgres too, but no pooler
        // spares them.
        let worker = |count| {
            labelled(
                &["ParallelWorkerMain", "InitPostgres"],
                &[(labels::BACKEND_TYPE, "parallel worker")],
                count,
            )
        };
        let client = |count| {
            labelled(
                &["PostgresMain", "InitPostgres"],
                &[(labels::BACKEND_TYPE, "client backend")],
                count,
            )
        };
        let query = sample(&["PostgresMain", "exec_simple_query"], 100);
        assert_eq!(
            connection_churn(&profile(vec![worker(100), query.clone()]), None, 3.0),
            None
        );
        let found = connection_churn(&profile(vec![client(100), query]), None, 3.0).unwrap();
        assert_eq!(found.kind, "connection_churn");
    }

    #[test]
    fn too_few_samples_say_nothing() {
        let few = profile(vec![sample(&["InitPostgres"], 10)]);
        assert_eq!(connection_churn(&few, None, 1.0), None);
    }
}
