//! From per-statement diagnoses to findings a DBA reads: one per cause, severity from what the
//! cause costs the instance.
//!
//! The rules judge each statement alone ("this function takes 80% of this statement"). That
//! says what a statement is made of, not whether it matters: a statement that runs twice in
//! the window and one that runs all the time get the same verdict, and one pattern running
//! under a hundred queryids (the same command over many tables) gives a hundred findings.
//! Here the findings of one rule over the same functions become one, listing the statements it
//! covers, and a finding's severity is capped by its cost to the instance: its share of all
//! the backend time measured and its absolute rate. Below the floor nothing is more than
//! information.

use std::collections::BTreeMap;

use super::{percent, Finding, Severity};
use crate::model::QueryId;

/// What a per-statement finding says of its statement, for grouping and severity.
#[derive(Clone, Debug, PartialEq)]
pub struct StatementCause {
    /// What the statements share, read after "N statements" ("spend most of their CPU
    /// parsing and planning").
    pub cause: String,
    /// Each statement's own figure ("62.0% of its CPU"), in the order of `query_ids`.
    pub figures: Vec<String>,
    /// What the mechanism cost over the window, in nanoseconds of backend time (on CPU, or on
    /// and off CPU where off-CPU time was measured).
    pub cost_ns: u64,
}

/// All the backend time measured over the window: what a finding's cost is a share of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InstanceTime {
    pub backend_ns: u64,
    pub seconds: f64,
}

/// Below this share of all backend time, or this rate (5% of a core), a cause is information
/// only: it is not what the instance spends its time on. (Planning pgbench's select under the
/// simple protocol costs 4-8% of its instance's backend time, measured here: usual, and no
/// warning.)
const WARNING_SHARE: f64 = 0.10;
const WARNING_MS_PER_S: f64 = 50.0;
/// A cause must cost this share of all backend time to be critical.
const CRITICAL_SHARE: f64 = 0.25;

/// Statements a grouped finding lists by name; the rest are counted.
pub const MAX_LISTED: usize = 10;

/// Merges the per-statement findings of one rule over the same functions and statement shape
/// (the command each statement's text begins with, where `command_of` knows it) into one, most
/// costly statement first, and caps every finding that has a cost by what it costs the
/// instance. Findings without a statement cause (instance-wide rules) pass unchanged.
pub fn group_and_weigh(
    findings: Vec<Finding>,
    instance: InstanceTime,
    command_of: impl Fn(QueryId) -> Option<String>,
) -> Vec<Finding> {
    type Key = (&'static str, Vec<String>, Option<String>);
    let mut groups: BTreeMap<Key, Vec<Finding>> = BTreeMap::new();
    let mut out = Vec::new();
    for finding in findings {
        if finding.cause.is_some() {
            let command = finding.query_ids.first().and_then(|&q| command_of(q));
            groups
                .entry((finding.kind, finding.frames.clone(), command))
                .or_default()
                .push(finding);
        } else {
            out.push(finding);
        }
    }
    let mut weighed = Vec::new();
    for ((_, _, command), mut members) in groups {
        members.sort_by_key(|f| {
            (
                std::cmp::Reverse(f.cause.as_ref().map_or(0, |c| c.cost_ns)),
                f.query_ids.first().copied(),
            )
        });
        let mut finding = if members.len() == 1 {
            members.remove(0)
        } else {
            merge(members, command.as_deref())
        };
        weigh(&mut finding, instance);
        weighed.push(finding);
    }
    // The costliest cause first within each severity (the caller sorts by severity, stably).
    weighed.sort_by_key(|f| std::cmp::Reverse(f.cause.as_ref().map_or(0, |c| c.cost_ns)));
    out.extend(weighed);
    for finding in &mut out {
        finding.numbers.retain(|(_, value)| has_support(value));
    }
    out
}

/// One finding for the statements of `members` (two or more, most costly first), all of them
/// `command` statements where that is known.
fn merge(members: Vec<Finding>, command: Option<&str>) -> Finding {
    let first = &members[0];
    let cause = first.cause.as_ref().map_or_else(String::new, |c| c.cause.clone());
    let severity = members.iter().map(|f| f.severity).max().unwrap_or(Severity::Info);
    let cost_ns: u64 = members
        .iter()
        .filter_map(|f| f.cause.as_ref())
        .map(|c| c.cost_ns)
        .sum();
    let mut query_ids: Vec<QueryId> = Vec::new();
    let mut figures = Vec::new();
    for member in &members {
        let member_figures = member.cause.as_ref().map(|c| c.figures.as_slice());
        for (i, query_id) in member.query_ids.iter().enumerate() {
            query_ids.push(*query_id);
            figures.push(member_figures.and_then(|f| f.get(i).cloned()).unwrap_or_default());
        }
    }
    let mut numbers = vec![
        ("statements".to_string(), query_ids.len().to_string()),
        (
            "figures below are of".to_string(),
            format!("queryid {}, the costliest", first_id(first)),
        ),
    ];
    numbers.extend(first.numbers.iter().cloned());
    Finding {
        kind: first.kind,
        severity,
        title: format!(
            "{} {}statements {cause}",
            query_ids.len(),
            command.map(|c| format!("{c} ")).unwrap_or_default()
        ),
        numbers,
        query_ids,
        frames: first.frames.clone(),
        action: first.action.clone(),
        cause: Some(StatementCause {
            cause,
            figures,
            cost_ns,
        }),
    }
}

fn first_id(finding: &Finding) -> String {
    finding
        .query_ids
        .first()
        .map_or_else(String::new, ToString::to_string)
}

/// Caps `finding`'s severity by its cost to the instance, and says the cost.
fn weigh(finding: &mut Finding, instance: InstanceTime) {
    let Some(cause) = &finding.cause else {
        return;
    };
    if instance.backend_ns == 0 || instance.seconds <= 0.0 {
        return;
    }
    let share = cause.cost_ns as f64 / instance.backend_ns as f64;
    let ms_per_s = cause.cost_ns as f64 / 1e6 / instance.seconds;
    let ceiling = if share < WARNING_SHARE || ms_per_s < WARNING_MS_PER_S {
        Severity::Info
    } else if share < CRITICAL_SHARE {
        Severity::Warning
    } else {
        Severity::Critical
    };
    finding.severity = finding.severity.min(ceiling);
    finding.numbers.push((
        "cost to the instance".into(),
        format!(
            "{} of all backend time measured ({:.0} ms over {:.1} s, {:.1} ms/s)",
            percent(share.min(1.0)),
            cause.cost_ns as f64 / 1e6,
            instance.seconds,
            ms_per_s
        ),
    ));
}

/// A cited figure needs something measured behind it: a count or share of zero is not
/// evidence of anything and is not printed.
fn has_support(value: &str) -> bool {
    let number = value
        .trim_end_matches('%')
        .trim()
        .parse::<f64>()
        .map(|v| v != 0.0);
    number.unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_statement(kind: &'static str, query_id: i64, cost_ns: u64, severity: Severity) -> Finding {
        Finding {
            kind,
            severity,
            title: format!("queryid {query_id} spends 90.0% of its CPU in f"),
            numbers: vec![("in f".into(), "90.0%".into()), ("samples".into(), "0".into())],
            query_ids: vec![QueryId(query_id)],
            frames: vec!["f".into()],
            action: "do less".into(),
            cause: Some(StatementCause {
                cause: "spend most of their CPU in f".into(),
                figures: vec![format!("{}% of its CPU", 90)],
                cost_ns,
            }),
        }
    }

    const ONE_SECOND: InstanceTime = InstanceTime {
        backend_ns: 1_000_000_000,
        seconds: 1.0,
    };

    #[test]
    fn one_rule_over_the_same_function_is_one_finding_listing_its_statements() {
        let found = group_and_weigh(
            vec![
                per_statement("f_rule", 1, 100_000_000, Severity::Critical),
                per_statement("f_rule", 2, 300_000_000, Severity::Critical),
                per_statement("other_rule", 3, 300_000_000, Severity::Warning),
            ],
            ONE_SECOND,
            |_| None,
        );
        assert_eq!(found.len(), 2, "{found:#?}");
        let grouped = found.iter().find(|f| f.kind == "f_rule").expect("grouped");
        assert_eq!(grouped.query_ids, vec![QueryId(2), QueryId(1)], "costliest first");
        assert_eq!(grouped.title, "2 statements spend most of their CPU in f");
        assert_eq!(grouped.severity, Severity::Critical, "40% of the instance");
        let cause = grouped.cause.as_ref().expect("cause");
        assert_eq!(cause.cost_ns, 400_000_000);
        assert_eq!(cause.figures.len(), 2);
        assert!(grouped
            .numbers
            .iter()
            .any(|(what, value)| what == "cost to the instance" && value.starts_with("40.0%")));
    }

    #[test]
    fn statements_of_another_command_are_another_finding() {
        let command = |q: QueryId| Some(if q.0 < 10 { "VACUUM" } else { "SELECT" }.to_string());
        let found = group_and_weigh(
            vec![
                per_statement("f_rule", 1, 300_000_000, Severity::Critical),
                per_statement("f_rule", 2, 300_000_000, Severity::Critical),
                per_statement("f_rule", 11, 300_000_000, Severity::Critical),
            ],
            ONE_SECOND,
            command,
        );
        let titles: Vec<&str> = found.iter().map(|f| f.title.as_str()).collect();
        assert_eq!(titles.len(), 2, "{titles:?}");
        assert!(titles.contains(&"2 VACUUM statements spend most of their CPU in f"));
        assert!(titles.contains(&"queryid 11 spends 90.0% of its CPU in f"));
    }

    #[test]
    fn severity_follows_the_cost_to_the_instance_not_the_share_of_a_statement() {
        let cheap = group_and_weigh(
            vec![per_statement("f_rule", 1, 90_000_000, Severity::Critical)],
            ONE_SECOND,
            |_| None,
        );
        assert_eq!(cheap[0].severity, Severity::Info, "9% of the instance");
        let middling = group_and_weigh(
            vec![per_statement("f_rule", 1, 100_000_000, Severity::Critical)],
            ONE_SECOND,
            |_| None,
        );
        assert_eq!(middling[0].severity, Severity::Warning, "10% of the instance");
        let quarter = group_and_weigh(
            vec![per_statement("f_rule", 1, 250_000_000, Severity::Critical)],
            ONE_SECOND,
            |_| None,
        );
        assert_eq!(quarter[0].severity, Severity::Critical, "25% of the instance");
        // A large share of an almost idle instance is under the absolute floor.
        let idle = group_and_weigh(
            vec![per_statement("f_rule", 1, 100_000_000, Severity::Critical)],
            InstanceTime {
                backend_ns: 200_000_000,
                seconds: 10.0,
            },
            |_| None,
        );
        assert_eq!(
            idle[0].severity,
            Severity::Info,
            "50% of the instance, but 10 ms/s"
        );
        // Grouping never raises what the rule said.
        let warned = group_and_weigh(
            vec![per_statement("f_rule", 1, 900_000_000, Severity::Warning)],
            ONE_SECOND,
            |_| None,
        );
        assert_eq!(warned[0].severity, Severity::Warning);
    }

    #[test]
    fn figures_without_support_are_not_cited() {
        let found = group_and_weigh(
            vec![per_statement("f_rule", 1, 500_000_000, Severity::Warning)],
            ONE_SECOND,
            |_| None,
        );
        assert!(found[0].numbers.iter().all(|(what, _)| what != "samples"));
        assert!(found[0].numbers.iter().any(|(what, _)| what == "in f"));
        assert!(has_support("12 ms"));
        assert!(has_support("0.0014%"));
        assert!(!has_support("0.0%"));
        assert!(!has_support("0"));
    }
}
