//! One cause, one finding (issue 36's contract (d)). Some mechanisms are measured by more than
//! one rule, each its own way: a generic plan's relation locking by the samples under
//! `GetCachedPlan` (with the lock manager's waits), by the probes' lock count per execution,
//! and by the probed function's share of the statement. Each rule is right, and a DBA given
//! all three reads three problems, with three costs for the same time. Where rules of one
//! mechanism name the same statement, the first of the mechanism's list stays (the one whose
//! cost counts the waits too), and the others' figures join it as confirmation.

use super::Finding;

/// Rules that measure one mechanism. A finding belongs to it when its rule is listed and,
/// for rules that are about any function (`function_dominance`), it cites one of `frames`.
struct Mechanism {
    /// Most complete first: the finding that stays.
    rules: &'static [&'static str],
    frames: &'static [&'static str],
    /// Rules that belong to the mechanism only through `frames`.
    by_frame: &'static [&'static str],
}

const MECHANISMS: &[Mechanism] = &[
    Mechanism {
        rules: &["generic_plan_locking", "generic_plan_locks", "function_dominance"],
        frames: &["GetCachedPlan", "LockRelationOid"],
        by_frame: &["function_dominance"],
    },
    // JIT compiles at executor start: the phase is the compilation.
    Mechanism {
        rules: &["jit_compilation", "phase_dominance"],
        frames: &["standard_ExecutorStart"],
        by_frame: &["phase_dominance"],
    },
    // A foreign key's checks run as AFTER triggers when the statement finishes: the finish phase
    // is the checks.
    Mechanism {
        rules: &["unindexed_foreign_key", "phase_dominance"],
        frames: &["standard_ExecutorFinish"],
        by_frame: &["phase_dominance"],
    },
    // A relation dropped at commit (ON COMMIT DROP, DROP in the transaction) is removed by the
    // commit: the commit phase's work is the catalog churn's.
    Mechanism {
        rules: &["catalog_churn", "phase_dominance"],
        frames: &["smgrDoPendingDeletes"],
        by_frame: &["phase_dominance"],
    },
];

/// The label of a folded finding's title among the one that stays's figures.
const CONFIRMED_BY: &str = "the same cause, measured another way";

/// The index in [`MECHANISMS`] of the mechanism `finding` measures, and its rank there.
fn mechanism_of(finding: &Finding) -> Option<(usize, usize)> {
    MECHANISMS.iter().enumerate().find_map(|(index, mechanism)| {
        let rank = mechanism.rules.iter().position(|rule| *rule == finding.kind)?;
        let cites = finding
            .frames
            .iter()
            .any(|frame| mechanism.frames.contains(&frame.as_str()));
        (!mechanism.by_frame.contains(&finding.kind) || cites).then_some((index, rank))
    })
}

/// Folds the findings of one mechanism about the same statements into one: the one whose rule
/// comes first in the mechanism, with the others' titles, figures and frames under it, in the
/// mechanism's order. Findings of no listed mechanism, and of one but about other statements,
/// pass unchanged; the order of the rest is kept.
pub fn one_finding_per_cause(findings: Vec<Finding>) -> Vec<Finding> {
    let keys: Vec<Option<(usize, usize)>> = findings
        .iter()
        .map(|f| mechanism_of(f).filter(|_| !f.query_ids.is_empty()))
        .collect();
    let same_cause = |i: usize, j: usize| {
        matches!((keys[i], keys[j]), (Some((a, _)), Some((b, _))) if a == b)
            && findings[i].query_ids == findings[j].query_ids
    };
    let rank = |i: usize| keys[i].map_or(usize::MAX, |(_, rank)| rank);
    let stays: Vec<usize> = (0..findings.len())
        .map(|i| {
            (0..findings.len())
                .filter(|&j| same_cause(i, j))
                .min_by_key(|&j| (rank(j), j))
                .unwrap_or(i)
        })
        .collect();
    let mut slots: Vec<Option<Finding>> = findings.into_iter().map(Some).collect();
    let mut folded: Vec<(usize, usize, Finding)> = Vec::new();
    for (i, &stay) in stays.iter().enumerate() {
        if stay != i {
            if let Some(finding) = slots[i].take() {
                folded.push((stay, rank(i), finding));
            }
        }
    }
    folded.sort_by_key(|(stay, rank, _)| (*stay, *rank));
    for (stay, _, finding) in folded {
        if let Some(stays) = slots[stay].as_mut() {
            fold(stays, finding);
        }
    }
    slots.into_iter().flatten().collect()
}

fn fold(stays: &mut Finding, other: Finding) {
    stays.severity = stays.severity.max(other.severity);
    stays.numbers.push((CONFIRMED_BY.to_string(), other.title));
    for (what, value) in other.numbers {
        if !stays.numbers.iter().any(|(label, _)| *label == what) {
            stays.numbers.push((what, value));
        }
    }
    for frame in other.frames {
        if !stays.frames.contains(&frame) {
            stays.frames.push(frame);
        }
    }
    if stays.cause.is_none() {
        stays.cause = other.cause;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::{Severity, StatementCause};
    use crate::model::QueryId;

    fn finding(kind: &'static str, query_id: i64, frames: &[&str], cost_ns: u64) -> Finding {
        Finding {
            kind,
            severity: Severity::Warning,
            title: format!("{kind} of {query_id}"),
            numbers: vec![(format!("{kind}'s figure"), "1".into())],
            query_ids: vec![QueryId(query_id)],
            frames: frames.iter().map(|f| f.to_string()).collect(),
            action: format!("{kind}'s advice"),
            cause: Some(StatementCause {
                cause: kind.into(),
                figures: vec!["1".into()],
                cost_ns,
            }),
        }
    }

    #[test]
    fn foreign_key_checks_that_scan_are_the_cause_of_their_finish_phase() {
        let findings = vec![
            finding(
                "phase_dominance",
                7,
                &["PortalDrop", "standard_ExecutorFinish"],
                98,
            ),
            finding("unindexed_foreign_key", 7, &["SPI_execute_snapshot"], 97),
        ];
        let merged = one_finding_per_cause(findings);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].kind, "unindexed_foreign_key");
        assert_eq!(merged[0].cause.as_ref().map(|c| c.cost_ns), Some(97));
    }

    #[test]
    fn a_commit_that_drops_the_relations_its_transaction_created_is_one_cause() {
        let findings = vec![
            finding(
                "phase_dominance",
                7,
                &["PreCommit_on_commit_actions", "smgrDoPendingDeletes"],
                90,
            ),
            finding("catalog_churn", 7, &["performMultipleDeletions"], 91),
            // Deferred triggers at commit: another cause.
            finding("phase_dominance", 8, &["AfterTriggerFireDeferred"], 50),
        ];
        let merged = one_finding_per_cause(findings);
        let kinds: Vec<&str> = merged.iter().map(|f| f.kind).collect();
        assert_eq!(kinds, vec!["catalog_churn", "phase_dominance"]);
        assert_eq!(merged[1].query_ids, vec![QueryId(8)]);
        assert!(merged[0]
            .numbers
            .iter()
            .any(|(label, value)| label == CONFIRMED_BY && value == "phase_dominance of 7"));
    }

    #[test]
    fn rules_of_one_mechanism_on_one_statement_are_one_finding_with_one_cost() {
        // Listed last first: the order the rules run in does not choose the one that stays.
        let findings = vec![
            finding("function_dominance", 7, &["LockRelationOid"], 100),
            finding(
                "generic_plan_locks",
                7,
                &["GetCachedPlan", "LockRelationOid"],
                300,
            ),
            finding(
                "generic_plan_locking",
                7,
                &["GetCachedPlan", "LockRelationOid"],
                477,
            ),
        ];
        let merged = one_finding_per_cause(findings);
        assert_eq!(merged.len(), 1, "{merged:#?}");
        let only = &merged[0];
        assert_eq!(only.kind, "generic_plan_locking");
        assert_eq!(only.cause.as_ref().map(|c| c.cost_ns), Some(477));
        assert_eq!(only.action, "generic_plan_locking's advice");
        let confirmations: Vec<&str> = only
            .numbers
            .iter()
            .filter(|(what, _)| what == CONFIRMED_BY)
            .map(|(_, title)| title.as_str())
            .collect();
        assert_eq!(
            confirmations,
            ["generic_plan_locks of 7", "function_dominance of 7"]
        );
        assert!(only
            .numbers
            .iter()
            .any(|(what, _)| what == "generic_plan_locks's figure"));
    }

    #[test]
    fn other_statements_and_other_functions_stay_apart() {
        let findings = vec![
            finding("generic_plan_locking", 7, &["GetCachedPlan"], 477),
            finding("generic_plan_locks", 8, &["GetCachedPlan"], 300),
            // Dominance by another function is another mechanism.
            finding("function_dominance", 7, &["pgss_store"], 100),
            finding("operator_spill", 7, &["tuplesort_performsort"], 50),
        ];
        let merged = one_finding_per_cause(findings);
        let kinds: Vec<(&str, i64)> = merged.iter().map(|f| (f.kind, f.query_ids[0].0)).collect();
        assert_eq!(merged.len(), 4, "{kinds:?}");
    }

    #[test]
    fn a_jit_finding_takes_in_its_statements_executor_start_phase() {
        let findings = vec![
            finding(
                "phase_dominance",
                7,
                &["PortalStart", "standard_ExecutorStart"],
                90,
            ),
            finding("jit_compilation", 7, &["llvm_compile_expr"], 80),
            // Another phase of the same statement is another cause.
            finding(
                "phase_dominance",
                7,
                &["PortalDrop", "standard_ExecutorFinish"],
                20,
            ),
        ];
        let merged = one_finding_per_cause(findings);
        let kinds: Vec<&str> = merged.iter().map(|f| f.kind).collect();
        assert_eq!(kinds, ["jit_compilation", "phase_dominance"], "{merged:#?}");
        assert!(merged[0].frames.iter().any(|f| f == "standard_ExecutorStart"));
        assert!(merged[1].frames.iter().any(|f| f == "standard_ExecutorFinish"));
    }
}
