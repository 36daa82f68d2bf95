//! The findings of each instance, evaluated every upload interval over what the interval
//! measured (the same rules as `pgscope trace`), for /metrics and the logs. Logs say what
//! changed — a finding that appeared, one that cleared — so that a steady instance does not
//! repeat itself every interval.

use std::collections::BTreeMap;

use exporters::Profile;
use tracing::info;

use super::probes::CallRow;
use crate::findings::{self, Evidence, Finding, ProbeRow, Severity};

/// Findings kept per instance, most severe first: /metrics has one series per finding, and
/// a rule speaks of one queryid at a time, so this bounds the series an instance can add.
pub const MAX_PER_INSTANCE: usize = 20;

/// What identifies a finding from one interval to the next: its rule and the queryid it
/// names (0: none). Its numbers change every time, and its severity may go back and forth
/// across a threshold: neither makes it a new finding.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FindingKey {
    pub kind: &'static str,
    pub query_id: i64,
}

impl FindingKey {
    fn of(finding: &Finding) -> Self {
        Self {
            kind: finding.kind,
            query_id: finding.query_ids.first().copied().unwrap_or(0),
        }
    }
}

/// An instance's findings in force, with their severity.
pub type InForce = BTreeMap<FindingKey, Severity>;

/// What an interval changed, as logged.
#[derive(Debug, Default, PartialEq)]
struct Changes {
    appeared: Vec<FindingKey>,
    cleared: Vec<FindingKey>,
}

/// Per instance (by its name, as its series are labelled): the findings of its last interval.
#[derive(Debug, Default)]
pub struct AgentFindings {
    current: BTreeMap<String, InForce>,
    evaluated: u64,
}

impl AgentFindings {
    /// Evaluates the rules over one instance's interval and logs what changed since its last.
    pub fn evaluate(
        &mut self,
        instance: &str,
        profiles: &[(&'static str, Profile)],
        rows: Option<&[CallRow]>,
    ) {
        let Some(on_cpu) = profiles
            .iter()
            .find(|(name, _)| *name == "process_cpu")
            .map(|(_, p)| p)
        else {
            return;
        };
        let off_cpu = profiles
            .iter()
            .find(|(name, _)| *name == "offcpu")
            .map(|(_, p)| p);
        let probes: Vec<ProbeRow> = rows
            .unwrap_or_default()
            .iter()
            .map(|row| ProbeRow {
                query_id: row.query_id,
                function: row.call.function,
                calls: row.calls,
                total_ns: row.total_ns,
            })
            .collect();
        let found = findings::evaluate(&Evidence {
            on_cpu,
            probes: &probes,
            off_cpu,
            // The agent holds no SQL connection of its own for these.
            pgss: None,
            instance: None,
            // The agent's probes count calls; call sites are `pgscope trace --probes s_lock`'s.
            spin_sites: &[],
        });
        self.evaluated += 1;
        self.update(instance, &found);
    }

    /// Replaces an instance's findings with `found` (bounded) and logs what changed: warnings
    /// and worse that appeared or cleared. Info findings (the top consumers, always there and
    /// reordering every interval) are on /metrics only.
    fn update(&mut self, instance: &str, found: &[Finding]) -> Changes {
        let kept = &found[..found.len().min(MAX_PER_INSTANCE)];
        let mut now = InForce::new();
        for finding in kept {
            // A rule may name a queryid twice; the most severe (first) stands.
            now.entry(FindingKey::of(finding)).or_insert(finding.severity);
        }
        let before = self.current.remove(instance).unwrap_or_default();
        let mut changes = Changes::default();
        for finding in kept.iter().filter(|f| f.severity > Severity::Info) {
            let key = FindingKey::of(finding);
            if before.contains_key(&key) || changes.appeared.contains(&key) {
                continue;
            }
            info!(
                instance,
                kind = finding.kind,
                severity = finding.severity.name(),
                queryid = key.query_id,
                action = %finding.action,
                "finding: {}",
                finding.title
            );
            changes.appeared.push(key);
        }
        for (key, severity) in &before {
            if now.contains_key(key) || *severity == Severity::Info {
                continue;
            }
            info!(
                instance,
                kind = key.kind,
                queryid = key.query_id,
                "finding cleared"
            );
            changes.cleared.push(key.clone());
        }
        self.current.insert(instance.to_string(), now);
        changes
    }

    /// The instance is gone: its findings go with it.
    pub fn forget(&mut self, instance: &str) {
        self.current.remove(instance);
    }

    /// For /metrics: per instance, its findings in force.
    pub fn snapshot(&self) -> FindingsSnapshot {
        FindingsSnapshot {
            current: self.current.clone(),
            evaluated: self.evaluated,
        }
    }
}

/// What /metrics shows of the findings.
#[derive(Clone, Debug, Default)]
pub struct FindingsSnapshot {
    pub current: BTreeMap<String, InForce>,
    pub evaluated: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finding(kind: &'static str, query_id: i64, severity: Severity) -> Finding {
        Finding {
            kind,
            severity,
            title: String::new(),
            numbers: Vec::new(),
            query_ids: vec![query_id],
            frames: Vec::new(),
            action: String::new(),
        }
    }

    #[test]
    fn an_instance_holds_its_last_intervals_findings_bounded_and_loses_them_when_gone() {
        let mut findings = AgentFindings::default();
        let many: Vec<Finding> = (0..30)
            .map(|q| finding("planning_dominated", q, Severity::Warning))
            .collect();
        findings.update("a", &many);
        findings.update("b", &[finding("top_cpu", 7, Severity::Info)]);
        let snapshot = findings.snapshot();
        assert_eq!(snapshot.current["a"].len(), MAX_PER_INSTANCE);
        assert_eq!(snapshot.current["b"].len(), 1);
        // The next interval replaces the last: what cleared is gone.
        findings.update("a", &[finding("phase_dominance", 3, Severity::Critical)]);
        let in_force: Vec<(FindingKey, Severity)> = findings.snapshot().current["a"]
            .iter()
            .map(|(k, s)| (k.clone(), *s))
            .collect();
        assert_eq!(
            in_force,
            vec![(
                FindingKey {
                    kind: "phase_dominance",
                    query_id: 3,
                },
                Severity::Critical
            )]
        );
        findings.forget("a");
        assert!(!findings.snapshot().current.contains_key("a"));
    }

    #[test]
    fn only_warnings_that_appear_or_clear_are_logged() {
        let mut findings = AgentFindings::default();
        let storm = finding("pgss_evictions", 0, Severity::Critical);
        let top = finding("top_cpu", 7, Severity::Info);
        let key = FindingKey::of(&storm);
        assert_eq!(
            findings.update("a", &[storm.clone(), top.clone()]),
            Changes {
                appeared: vec![key.clone()],
                cleared: Vec::new()
            }
        );
        // Unchanged: nothing to say, whatever its numbers or its severity did.
        assert_eq!(
            findings.update("a", &[storm.clone(), top.clone()]),
            Changes::default()
        );
        let milder = Finding {
            severity: Severity::Warning,
            ..storm
        };
        assert_eq!(findings.update("a", &[milder, top]), Changes::default());
        // The top consumer changing is not news in the logs.
        assert_eq!(
            findings.update("a", &[finding("top_cpu", 8, Severity::Info)]),
            Changes {
                appeared: Vec::new(),
                cleared: vec![key]
            }
        );
    }
}
