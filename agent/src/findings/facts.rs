//! Settings and sizes read over SQL, added to the findings they explain: a finding about
//! generic plans says what plan_cache_mode is, one about vac_update_datfrozenxid how many rows
//! pg_class has. The rules decide from what was measured; the facts only sharpen the numbers
//! and the action.

use std::collections::BTreeMap;

use super::Finding;
use crate::bpf::abi::Function;
use crate::model::QueryId;
use crate::postgres::sql::InstanceFacts;

/// `plan_cache_mode` as the statements `query_ids` ran with it: what their backends had (read
/// from their memory, so a setting per role, database or client counts), else pgscope's own
/// session's. Returns the figure to quote and the mode most of their samples ran with.
fn plan_cache_mode_of(query_ids: &[QueryId], facts: &InstanceFacts) -> (String, String) {
    let mut samples: BTreeMap<&str, u64> = BTreeMap::new();
    for query_id in query_ids {
        for (mode, n) in facts
            .plan_cache_modes_by_query
            .get(&query_id.to_string())
            .into_iter()
            .flatten()
        {
            *samples.entry(mode.as_str()).or_default() += n;
        }
    }
    let total: u64 = samples.values().sum();
    let Some((&main, _)) = samples
        .iter()
        .max_by_key(|(mode, n)| (**n, std::cmp::Reverse(**mode)))
    else {
        let session = facts.plan_cache_mode.clone();
        return (
            format!("{session} (pgscope's own session; the statement's backends were not read)"),
            session,
        );
    };
    let shown = if samples.len() == 1 {
        format!("{main} (as the statement's backends ran it)")
    } else {
        let parts: Vec<String> = samples
            .iter()
            .map(|(mode, n)| {
                format!(
                    "{mode} in {:.0}% of its samples",
                    100.0 * *n as f64 / total as f64
                )
            })
            .collect();
        format!("{} (the statement's backends differ)", parts.join(", "))
    };
    (shown, main.to_string())
}

/// pg_class's rows as the statements `query_ids` saw them: in each database they ran in,
/// where that catalog was read; else pgscope's own database's, saying so.
fn pg_class_rows(query_ids: &[QueryId], facts: &InstanceFacts) -> Vec<(String, String)> {
    let mut databases: Vec<&str> = query_ids
        .iter()
        .flat_map(|q| facts.databases_by_query.get(&q.to_string()).into_iter().flatten())
        .map(String::as_str)
        .collect();
    databases.sort_unstable();
    databases.dedup();
    let read: Vec<(String, String)> = databases
        .iter()
        .filter_map(|db| {
            let rows = facts.relations_by_database.get(*db)?;
            Some((format!("pg_class rows (database {db})"), rows.to_string()))
        })
        .collect();
    if !read.is_empty() {
        return read;
    }
    vec![(
        format!(
            "pg_class rows (database {}, pgscope's connection: the statements' was not read)",
            facts.database
        ),
        facts.relations.to_string(),
    )]
}

pub fn annotate(findings: &mut [Finding], facts: &InstanceFacts) {
    for finding in findings {
        let frames = |name: &str| finding.frames.iter().any(|f| f == name);
        let (shown, mode) = plan_cache_mode_of(&finding.query_ids, facts);
        let mode = mode.as_str();
        match finding.kind {
            "generic_plan_locking" | "generic_plan_locks" => {
                finding.numbers.push(("plan_cache_mode".into(), shown));
                if mode == "force_generic_plan" {
                    finding.action = format!(
                        "plan_cache_mode is force_generic_plan, which makes every prepared statement use \
                         its generic plan: `auto` lets a custom plan win where it is cheaper; {}",
                        finding.action
                    );
                }
            }
            "planning_dominated" => {
                finding.numbers.push(("plan_cache_mode".into(), shown));
                if mode == "force_custom_plan" {
                    finding.action = format!(
                        "plan_cache_mode is force_custom_plan, which plans every execution of a prepared \
                         statement anew: `auto` keeps a generic plan once it is as cheap; {}",
                        finding.action
                    );
                }
            }
            "function_dominance" if frames(Function::VacUpdateDatfrozenxid.name()) => {
                finding.numbers.extend(pg_class_rows(&finding.query_ids, facts));
            }
            "function_dominance" | "pgss_evictions" | "spin_site"
                if finding
                    .frames
                    .iter()
                    .any(|f| f.starts_with(Function::PgssStore.name())) =>
            {
                if let Some(on) = facts.track_planning {
                    finding.numbers.push((
                        "pg_stat_statements.track_planning".into(),
                        if on { "on" } else { "off" }.into(),
                    ));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::Severity;
    use crate::model::QueryId;

    fn finding(kind: &'static str, frames: &[&str]) -> Finding {
        Finding {
            kind,
            severity: Severity::Warning,
            title: String::new(),
            numbers: Vec::new(),
            query_ids: vec![QueryId(7)],
            frames: frames.iter().map(|f| f.to_string()).collect(),
            action: "act".into(),
            cause: None,
        }
    }

    #[test]
    fn facts_go_to_the_findings_they_explain_only() {
        let facts = InstanceFacts {
            plan_cache_mode: "force_generic_plan".into(),
            track_planning: Some(true),
            database: "postgres".into(),
            relations: 410,
            plan_cache_modes_by_query: BTreeMap::new(),
            relations_by_database: BTreeMap::from([("app".to_string(), 20412)]),
            databases_by_query: BTreeMap::from([("7".to_string(), vec!["app".to_string()])]),
            commands_by_query: BTreeMap::new(),
        };
        let mut findings = vec![
            finding("generic_plan_locks", &["GetCachedPlan", "LockRelationOid"]),
            finding("function_dominance", &["vac_update_datfrozenxid"]),
            finding("function_dominance", &["pgss_store"]),
            finding("top_cpu", &[]),
        ];
        annotate(&mut findings, &facts);
        assert!(findings[0]
            .action
            .starts_with("plan_cache_mode is force_generic_plan"));
        assert_eq!(
            findings[1].numbers,
            vec![("pg_class rows (database app)".to_string(), "20412".to_string())]
        );
        // A statement whose database was not read: pgscope's own, said to be.
        let mut elsewhere = vec![Finding {
            query_ids: vec![QueryId(8)],
            ..finding("function_dominance", &["vac_update_datfrozenxid"])
        }];
        annotate(&mut elsewhere, &facts);
        assert_eq!(
            elsewhere[0].numbers,
            vec![(
                "pg_class rows (database postgres, pgscope's connection: the statements' was not read)"
                    .to_string(),
                "410".to_string()
            )]
        );
        assert_eq!(
            findings[2].numbers,
            vec![("pg_stat_statements.track_planning".to_string(), "on".to_string())]
        );
        assert!(findings[3].numbers.is_empty() && findings[3].action == "act");
    }

    /// A setting given per role or by the client is what the statement's backends ran with,
    /// whatever pgscope's own session says.
    #[test]
    fn plan_cache_mode_is_quoted_as_the_statements_backends_ran_it() {
        let modes = |list: &[(&str, u64)]| list.iter().map(|(m, n)| (m.to_string(), *n)).collect();
        let facts = InstanceFacts {
            plan_cache_mode: "auto".into(),
            track_planning: None,
            database: "postgres".into(),
            relations: 400,
            plan_cache_modes_by_query: BTreeMap::from([
                ("7".to_string(), modes(&[("force_generic_plan", 90)])),
                ("8".to_string(), modes(&[("auto", 25), ("force_custom_plan", 75)])),
            ]),
            relations_by_database: BTreeMap::new(),
            databases_by_query: BTreeMap::new(),
            commands_by_query: BTreeMap::new(),
        };
        let quoted = |query_id: i64| {
            let mut found = vec![Finding {
                query_ids: vec![QueryId(query_id)],
                ..finding("generic_plan_locks", &[])
            }];
            annotate(&mut found, &facts);
            let finding = found.remove(0);
            let mode = finding
                .numbers
                .iter()
                .find(|(k, _)| k == "plan_cache_mode")
                .cloned();
            (mode.map(|(_, v)| v).unwrap_or_default(), finding.action)
        };
        let (mode, action) = quoted(7);
        assert_eq!(mode, "force_generic_plan (as the statement's backends ran it)");
        assert!(
            action.starts_with("plan_cache_mode is force_generic_plan"),
            "{action}"
        );
        let (mode, action) = quoted(8);
        assert_eq!(
            mode,
            "auto in 25% of its samples, force_custom_plan in 75% of its samples (the statement's backends differ)"
        );
        assert_eq!(action, "act");
        let (mode, _) = quoted(9);
        assert_eq!(
            mode,
            "auto (pgscope's own session; the statement's backends were not read)"
        );
    }
}
