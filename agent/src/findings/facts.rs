//! Settings and sizes read over SQL, added to the findings they explain: a finding about
//! generic plans says what plan_cache_mode is, one about vac_update_datfrozenxid how many rows
//! pg_class has. The rules decide from what was measured; the facts only sharpen the numbers
//! and the action.

use super::Finding;
use crate::bpf::abi::Function;
use crate::postgres::sql::InstanceFacts;

pub fn annotate(findings: &mut [Finding], facts: &InstanceFacts) {
    let mode = facts.plan_cache_mode.as_str();
    for finding in findings {
        let frames = |name: &str| finding.frames.iter().any(|f| f == name);
        match finding.kind {
            "generic_plan_locking" | "generic_plan_locks" => {
                finding.numbers.push(("plan_cache_mode".into(), mode.into()));
                if mode == "force_generic_plan" {
                    finding.action = format!(
                        "plan_cache_mode is force_generic_plan, which makes every prepared statement use \
                         its generic plan: `auto` lets a custom plan win where it is cheaper; {}",
                        finding.action
                    );
                }
            }
            "planning_dominated" => {
                finding.numbers.push(("plan_cache_mode".into(), mode.into()));
                if mode == "force_custom_plan" {
                    finding.action = format!(
                        "plan_cache_mode is force_custom_plan, which plans every execution of a prepared \
                         statement anew: `auto` keeps a generic plan once it is as cheap; {}",
                        finding.action
                    );
                }
            }
            "function_dominance" if frames(Function::VacUpdateDatfrozenxid.name()) => {
                finding.numbers.push((
                    format!("pg_class rows (database {})", facts.database),
                    facts.relations.to_string(),
                ));
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
        }
    }

    #[test]
    fn facts_go_to_the_findings_they_explain_only() {
        let facts = InstanceFacts {
            plan_cache_mode: "force_generic_plan".into(),
            track_planning: Some(true),
            database: "app".into(),
            relations: 20412,
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
        assert_eq!(
            findings[2].numbers,
            vec![("pg_stat_statements.track_planning".to_string(), "on".to_string())]
        );
        assert!(findings[3].numbers.is_empty() && findings[3].action == "act");
    }
}
