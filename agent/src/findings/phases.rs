//! Statements whose CPU goes to a phase that is normally short. A statement runs parse,
//! analysis, planning, executor start, run, finish and commit; for almost every statement the
//! time is in run (or in planning, which `planning_dominated` covers). When executor start,
//! finish or work deferred to commit takes most of it, Postgres is doing work around the
//! statement rather than the statement itself, and that work is named by the phase: it is
//! also work pg_stat_statements times elsewhere or not at all. The commit's own work (flushing
//! WAL: a COMMIT statement is all commit) is not unusual, so only deferred work counts there.

use super::cpu::{statements, supported_share};
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;
use crate::postgres::phase::Phase;

/// A phase this share of a statement's CPU dominates it.
const DOMINANT: f64 = 0.40;
/// The share the samples must support with 95% confidence: a statement whose phase holds a
/// third of its time is not named on a lucky draw of 140 samples.
const SUPPORTED: f64 = 0.30;
const CRITICAL: f64 = 0.70;

/// Why a phase can take a statement's time, the frames to look under, and what to consider.
struct Unusual {
    phase: Phase,
    /// The samples of the phase that count: the whole phase, or a part of it.
    counted: fn(&StatementCpu) -> u64,
    what: &'static str,
    frames: &'static [&'static str],
    action: &'static str,
}

const UNUSUAL: [Unusual; 3] = [
    Unusual {
        phase: Phase::ExecutorStart,
        counted: |q| q.phase(Phase::ExecutorStart),
        what: "starting its executor (opening, locking and initializing every relation and \
               node of the plan, initial partition pruning, JIT code generation)",
        frames: &[
            "PortalStart",
            "standard_ExecutorStart",
            "InitPlan",
            "ExecInitNode",
        ],
        action: "a plan over many partitions or relations is initialized at every execution: \
                 check that pruning happens at plan time (constants rather than parameters, or \
                 plan_cache_mode = force_custom_plan), that the plan does not reference far more \
                 partitions than it reads, and whether JIT (jit_above_cost) compiles more than \
                 the statement is worth",
    },
    Unusual {
        phase: Phase::Finish,
        // Not foreign-key checks that do not scan the other table: one lookup per row changed
        // is the constraint's usual cost (a one-row DELETE with one indexed key spends 40% of
        // its CPU finishing, measured). Checks that scan it are named by
        // `unindexed_foreign_key`, into which this finding then folds.
        counted: |q| {
            let fk = q.fk_actions;
            let usual = if fk.scan_the_table() { 0 } else { fk.samples };
            q.phase(Phase::Finish).saturating_sub(usual)
        },
        what: "finishing (AFTER triggers fired at the end of the statement, ExecutorEnd \
               closing what the plan opened)",
        frames: &["PortalDrop", "standard_ExecutorFinish", "standard_ExecutorEnd"],
        action: "look at the AFTER triggers and foreign-key checks on the tables it modifies \
                 (their functions' statements are timed as their own only with \
                 pg_stat_statements.track = all), and at plans that open many partitions",
    },
    Unusual {
        phase: Phase::Commit,
        counted: |q| q.deferred_to_commit,
        what: "work deferred to commit (deferred triggers and constraints, ON COMMIT actions, \
               NOTIFY, removing dropped relations' files)",
        // Each kind of deferred work; a finding keeps those sampled under its statement.
        frames: &[
            "CommitTransactionCommand",
            "CommitTransaction",
            "AfterTriggerFireDeferred",
            "PreCommit_on_commit_actions",
            "PreCommit_Notify",
            "smgrDoPendingDeletes",
        ],
        action: "work deferred to commit (DEFERRABLE INITIALLY DEFERRED constraint triggers, \
                 deferred foreign keys, ON COMMIT DELETE ROWS temporary tables) runs after the \
                 statement: pg_stat_statements does not count it in this statement's time; \
                 check the deferred triggers of the tables it writes and whether they need to \
                 be deferred",
    },
];

/// Triggers named in a finding, most samples first.
const TRIGGERS_NAMED: usize = 3;

/// The triggers a statement's samples ran in, as a finding quotes them: `constraint
/// fk_child_parent_id_fkey 98.9%, trigger audit 0.4%`; None when no sample was in one.
fn triggers_sampled(q: &StatementCpu) -> Option<String> {
    let mut by_samples: Vec<(&String, &u64)> = q.triggers.iter().collect();
    by_samples.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let named: Vec<String> = by_samples
        .iter()
        .take(TRIGGERS_NAMED)
        .map(|(name, &n)| format!("{name} {}", percent(n as f64 / q.samples as f64)))
        .collect();
    (!named.is_empty()).then(|| named.join(", "))
}

/// Statements dominated by executor start, finish or commit.
pub fn unusual_phase(queries: &[StatementCpu], period_ns: u64) -> Vec<Finding> {
    let mut findings = Vec::new();
    for q in statements(queries) {
        for unusual in &UNUSUAL {
            let counted = (unusual.counted)(q);
            let share = counted as f64 / q.samples as f64;
            if share < DOMINANT || supported_share(counted, q.samples) < SUPPORTED {
                continue;
            }
            let mut numbers = vec![
                (format!("in {}", unusual.phase.label()), percent(share)),
                (
                    "in run".into(),
                    percent(q.phase(Phase::Run) as f64 / q.samples as f64),
                ),
                ("samples".into(), q.samples.to_string()),
                ("what the phase does".into(), unusual.what.into()),
            ];
            // The triggers its samples ran in, by name: what to look at first.
            let triggers = triggers_sampled(q);
            if let Some(triggers) = &triggers {
                numbers.push(("in triggers".into(), triggers.clone()));
            }
            let action = match &triggers {
                Some(triggers) if unusual.phase != Phase::ExecutorStart => {
                    format!(
                        "its samples ran in these triggers: {triggers}; {}",
                        unusual.action
                    )
                }
                _ => unusual.action.to_string(),
            };
            findings.push(Finding {
                kind: "phase_dominance",
                severity: Severity::warning_or_critical(share, CRITICAL),
                title: format!(
                    "queryid {} spends {} of its CPU in {}, not running the statement",
                    q.query_id,
                    percent(share),
                    unusual.phase.label()
                ),
                numbers,
                query_ids: vec![q.query_id],
                frames: unusual.frames.iter().map(|f| f.to_string()).collect(),
                action,
                cause: Some(StatementCause {
                    cause: format!(
                        "spend most of their CPU in {}, not running the statement",
                        unusual.phase.label()
                    ),
                    figures: vec![format!("{} of its CPU", percent(share))],
                    cost_ns: counted * period_ns,
                }),
            });
        }
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{profile, sample};
    use crate::model::statements::statements as table;
    use crate::model::QueryId;

    #[test]
    fn indexed_foreign_key_checks_are_not_unusual_finishing_and_scanning_ones_are() {
        let check = |fetch: &'static str| -> Vec<&'static str> {
            vec![
                "PostgresMain",
                "standard_ExecutorFinish",
                "AfterTriggerEndQuery",
                "SPI_execute_snapshot",
                fetch,
            ]
        };
        let p = profile(vec![
            sample(7, "finish", &check("index_getnext_slot"), 45),
            sample(7, "finish", &["PostgresMain", "standard_ExecutorFinish"], 10),
            sample(7, "run", &["PostgresMain", "PortalRun"], 45),
            sample(8, "finish", &check("heap_getnextslot"), 60),
            sample(8, "run", &["PostgresMain", "PortalRun"], 40),
        ]);
        let found = unusual_phase(&table(&p), 1);
        let named: Vec<QueryId> = found.iter().flat_map(|f| f.query_ids.clone()).collect();
        assert_eq!(named, vec![QueryId(8)]);
    }

    #[test]
    fn a_statement_mostly_committing_is_named_and_one_mostly_running_is_not() {
        let p = profile(vec![
            sample(
                7,
                "commit",
                &[
                    "PostgresMain",
                    "CommitTransactionCommand",
                    "AfterTriggerFireDeferred",
                ],
                80,
            ),
            sample(7, "run", &["PostgresMain", "PortalRun"], 20),
            sample(8, "run", &["PostgresMain", "PortalRun"], 80),
            sample(8, "commit", &["PostgresMain", "CommitTransactionCommand"], 20),
            // A COMMIT statement is all commit, flushing WAL: not unusual.
            sample(10, "commit", &["CommitTransactionCommand", "XLogFlush"], 95),
            sample(10, "run", &["PortalRun", "standard_ProcessUtility"], 5),
            sample(9, "executor_start", &["PortalStart", "InitPlan"], 45),
            sample(9, "run", &["PortalRun"], 55),
        ]);
        let found = unusual_phase(&table(&p), 1);
        let named: Vec<(QueryId, Severity)> = found.iter().map(|f| (f.query_ids[0], f.severity)).collect();
        assert_eq!(
            named,
            vec![(QueryId(7), Severity::Critical), (QueryId(9), Severity::Warning)],
            "{found:?}"
        );
        assert!(found[0].title.contains("in commit"), "{}", found[0].title);
    }

    #[test]
    fn the_triggers_a_finishing_statement_ran_in_are_named() {
        let mut trigger = sample(
            7,
            "finish",
            &["PortalRun", "standard_ExecutorFinish", "AfterTriggerEndQuery"],
            90,
        );
        trigger
            .labels
            .push(("trigger".into(), "constraint fk_child_parent_id_fkey".into()));
        let p = profile(vec![trigger, sample(7, "run", &["PortalRun"], 10)]);
        let found = unusual_phase(&table(&p), 1);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].numbers.contains(&(
                "in triggers".into(),
                "constraint fk_child_parent_id_fkey 90.0%".into()
            )),
            "{:?}",
            found[0].numbers
        );
        assert!(
            found[0]
                .action
                .starts_with("its samples ran in these triggers: constraint fk_child_parent_id_fkey 90.0%"),
            "{}",
            found[0].action
        );
    }

    #[test]
    fn too_few_samples_or_queryid_0_say_nothing() {
        let few = profile(vec![sample(7, "commit", &["CommitTransactionCommand"], 10)]);
        assert!(unusual_phase(&table(&few), 1).is_empty());
        let unknown = profile(vec![sample(0, "finish", &["PortalDrop"], 100)]);
        assert!(unusual_phase(&table(&unknown), 1).is_empty());
    }
}
