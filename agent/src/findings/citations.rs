//! The first part of every finding's contract: a function a finding cites about statements was
//! sampled under them. Rules name the functions their mechanism runs through (a commit-phase
//! finding: the deferred-trigger, ON COMMIT and NOTIFY functions); a DBA reading one that never
//! ran looks for a trigger that does not exist. Enforced here once for every rule, rather than
//! trusted to each.

use std::collections::{HashMap, HashSet};

use exporters::Profile;

use super::Finding;
use crate::model::labels::SampleLabels;
use crate::model::QueryId;

/// Rules whose functions are counted by function probes under the statement (calls, spins at
/// a call site), not by samples: what they cite was measured there, by the probe.
const PROBED: &[&str] = &["generic_plan_locks", "spin_site", "function_dominance"];

/// Drops from each finding about statements the functions not sampled under any of them, on
/// CPU (`on_cpu`) or off it (`off_cpu`).
pub fn cite_only_sampled(findings: &mut [Finding], on_cpu: &Profile, off_cpu: Option<&Profile>) {
    let cited: HashSet<QueryId> = findings
        .iter()
        .filter(|f| judged(f))
        .flat_map(|f| f.query_ids.iter().copied())
        .collect();
    if cited.is_empty() {
        return;
    }
    let mut sampled: HashMap<QueryId, HashSet<&str>> = HashMap::new();
    for sample in on_cpu
        .samples
        .iter()
        .chain(off_cpu.iter().flat_map(|p| &p.samples))
    {
        let Some(query_id) = sample.query_id().filter(|q| cited.contains(q)) else {
            continue;
        };
        sampled
            .entry(query_id)
            .or_default()
            .extend(sample.frames.iter().map(|f| &*f.name));
    }
    for finding in findings.iter_mut().filter(|f| judged(f)) {
        let query_ids = &finding.query_ids;
        finding.frames.retain(|frame| {
            query_ids
                .iter()
                .any(|q| sampled.get(q).is_some_and(|names| names.contains(frame.as_str())))
        });
    }
}

/// Whether `finding`'s functions are judged against samples: it speaks of statements and its
/// rule does not count them with probes.
fn judged(finding: &Finding) -> bool {
    !finding.query_ids.is_empty() && !PROBED.contains(&finding.kind)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::Severity;
    use crate::model::fixtures::{labelled, off_cpu, profile, sample};
    use crate::model::labels;

    fn finding(kind: &'static str, query_ids: &[i64], frames: &[&str]) -> Finding {
        Finding {
            kind,
            severity: Severity::Warning,
            title: String::new(),
            numbers: Vec::new(),
            query_ids: query_ids.iter().map(|&q| QueryId(q)).collect(),
            frames: frames.iter().map(|f| f.to_string()).collect(),
            action: String::new(),
            cause: None,
        }
    }

    #[test]
    fn a_finding_cites_only_the_functions_sampled_under_its_statements() {
        let on_cpu = profile(vec![
            sample(
                7,
                "commit",
                &["CommitTransaction", "PreCommit_on_commit_actions"],
                40,
            ),
            sample(8, "run", &["PortalRun", "AfterTriggerFireDeferred"], 5),
        ]);
        let waits = off_cpu(vec![labelled(
            &["ProcSleep", "WaitLatch"],
            &[(labels::QUERY_ID, "7"), (labels::OFF_CPU, "lock")],
            1_000,
        )]);
        let mut findings = vec![
            // The commit phase of statement 7 ran ON COMMIT actions, no deferred trigger
            // (which statement 8 ran: not this finding's).
            finding(
                "phase_dominance",
                &[7],
                &[
                    "CommitTransaction",
                    "AfterTriggerFireDeferred",
                    "PreCommit_on_commit_actions",
                ],
            ),
            // Off-CPU frames count.
            finding("top_wait", &[7], &["ProcSleep"]),
            // Probed functions were counted under the statement by their probes.
            finding("generic_plan_locks", &[7], &["GetCachedPlan", "LockRelationOid"]),
            // Instance-wide findings cite what the instance ran.
            finding("spinlock_contention", &[], &["s_lock"]),
        ];
        cite_only_sampled(&mut findings, &on_cpu, Some(&waits));
        let frames = |i: usize| findings[i].frames.clone();
        assert_eq!(frames(0), ["CommitTransaction", "PreCommit_on_commit_actions"]);
        assert_eq!(frames(1), ["ProcSleep"]);
        assert_eq!(frames(2), ["GetCachedPlan", "LockRelationOid"]);
        assert_eq!(frames(3), ["s_lock"]);
    }
}
