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
    let samples = summed(query_ids, &facts.plan_cache_modes_by_query);
    let Some((main, _)) = samples
        .iter()
        .max_by_key(|(mode, n)| (**n, std::cmp::Reverse(mode.as_str())))
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
        differing(&samples)
    };
    (shown, main.clone())
}

/// Samples per value of the statements `query_ids`, from a by-queryid table, strays left out.
fn summed(
    query_ids: &[QueryId],
    by_query: &BTreeMap<String, BTreeMap<String, u64>>,
) -> BTreeMap<String, u64> {
    let mut samples: BTreeMap<String, u64> = BTreeMap::new();
    for query_id in query_ids {
        for (value, n) in by_query.get(&query_id.to_string()).into_iter().flatten() {
            *samples.entry(value.clone()).or_default() += n;
        }
    }
    without_strays(samples)
}

/// A value below this share of a statement's samples is a stray (one backend's sample or two
/// among thousands) and not quoted: "the statement's backends differ" over a value held in 0%
/// of its samples tells a DBA nothing.
const STRAY_SHARE: f64 = 0.02;

/// `samples` without the values under [`STRAY_SHARE`] of them.
fn without_strays<K: Ord>(mut samples: BTreeMap<K, u64>) -> BTreeMap<K, u64> {
    let total: u64 = samples.values().sum();
    samples.retain(|_, n| *n as f64 >= STRAY_SHARE * total as f64);
    samples
}

/// Each value's share of `samples`, quoted as [`plan_cache_mode_of`] quotes backends that differ.
fn differing(samples: &BTreeMap<String, u64>) -> String {
    let total: u64 = samples.values().sum::<u64>().max(1);
    let parts: Vec<String> = samples
        .iter()
        .map(|(value, n)| {
            format!(
                "{value} in {:.0}% of its samples",
                100.0 * *n as f64 / total as f64
            )
        })
        .collect();
    format!("{} (the statement's backends differ)", parts.join(", "))
}

/// `pg_stat_statements.track_planning` as the statements `query_ids` ran with it, with where
/// each value came from: resolved from the catalog for the (database, role) their backends ran
/// as (the variable is not exported, so it cannot be read from their memory); else pgscope's
/// own session's, saying so. None where the extension is not loaded.
fn track_planning_of(query_ids: &[QueryId], facts: &InstanceFacts) -> Option<String> {
    let mut samples: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for query_id in query_ids {
        for session in facts
            .sessions_by_query
            .get(&query_id.to_string())
            .into_iter()
            .flatten()
        {
            let Some(setting) = facts
                .track_planning_by_session
                .iter()
                .find(|s| s.database == session.database && s.role == session.role)
            else {
                continue;
            };
            let value = match setting.value {
                Some(true) => "on",
                Some(false) => "off",
                None => "unknown",
            };
            *samples.entry((value, setting.source.as_str())).or_default() += session.samples;
        }
    }
    let samples = without_strays(samples);
    match samples.len() {
        0 => facts.track_planning.map(|on| {
            format!(
                "{} (pgscope's own session; the statement's backends were not read)",
                if on { "on" } else { "off" }
            )
        }),
        1 => samples
            .keys()
            .next()
            .map(|(value, source)| format!("{value} ({source}, as the statement's backends ran)")),
        _ => Some(differing(
            &samples
                .into_iter()
                .map(|((value, source), n)| (format!("{value} ({source})"), n))
                .collect(),
        )),
    }
}

/// `jit` as the statements `query_ids` ran with it, read from their backends' memory.
fn jit_of(query_ids: &[QueryId], facts: &InstanceFacts) -> Option<String> {
    let samples = summed(query_ids, &facts.jit_by_query);
    match samples.len() {
        0 => None,
        1 => samples
            .keys()
            .next()
            .map(|value| format!("{value} (as the statement's backends ran it)")),
        _ => Some(differing(&samples)),
    }
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
                // A finding of the whole instance (evictions): as every sampled backend ran it.
                let every: Vec<QueryId>;
                let query_ids = if finding.query_ids.is_empty() {
                    every = facts
                        .sessions_by_query
                        .keys()
                        .filter_map(|q| q.parse().ok().map(QueryId))
                        .collect();
                    &every
                } else {
                    &finding.query_ids
                };
                if let Some(shown) = track_planning_of(query_ids, facts) {
                    finding
                        .numbers
                        .push(("pg_stat_statements.track_planning".into(), shown));
                }
            }
            // Executor start is where JIT compiles the plan's expressions.
            "phase_dominance" if frames("standard_ExecutorStart") => {
                if let Some(shown) = jit_of(&finding.query_ids, facts) {
                    finding.numbers.push(("jit".into(), shown));
                }
                if let Some(shown) = pgss_of(&finding.query_ids, facts).map(jit_compiled) {
                    finding
                        .numbers
                        .push(("JIT over the trace (pg_stat_statements)".into(), shown));
                }
            }
            // The rule judged from the counters; the setting is read here like every fact.
            "jit_compilation" => {
                if let Some(shown) = jit_of(&finding.query_ids, facts) {
                    finding.numbers.push(("jit".into(), shown));
                }
            }
            _ => {}
        }
        if let Some(shown) = pgss_of(&finding.query_ids, facts).and_then(statement_counts) {
            let what = match finding.query_ids.len() {
                1 => "pg_stat_statements over the trace".to_string(),
                _ => format!(
                    "pg_stat_statements over the trace (statement {})",
                    finding.query_ids[0]
                ),
            };
            finding.numbers.push((what, shown));
        }
    }
}

/// The growth of pg_stat_statements' counters over the trace of the first of `query_ids`.
fn pgss_of<'a>(query_ids: &[QueryId], facts: &'a InstanceFacts) -> Option<&'a BTreeMap<String, f64>> {
    facts.pgss_deltas_by_query.get(&query_ids.first()?.to_string())
}

/// What JIT compiled for the statement over the trace: how many functions and how long it
/// took (generation, inlining, optimization, emission, and deforming in 17+), or that it
/// compiled nothing, which rules JIT out as executor start's cost.
fn jit_compiled(counters: &BTreeMap<String, f64>) -> String {
    let functions = counters.get("jit_functions").copied().unwrap_or(0.0);
    if functions == 0.0 {
        return "nothing compiled (jit_functions 0): not JIT".to_string();
    }
    let ms: f64 = counters
        .iter()
        .filter(|(name, _)| name.starts_with("jit_") && name.ends_with("_time"))
        .map(|(_, ms)| ms)
        .sum();
    format!("{functions:.0} functions compiled, {ms:.1} ms compiling")
}

/// `512 B`, `12.3 KiB`, `4.7 MiB`, `1.2 GiB`.
fn bytes(n: f64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{value:.0} B"),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

/// pg_stat_statements' account of a statement over the trace, in one line: its calls, time
/// and rows per call, and what else it did where it did any (planned, read blocks from
/// outside shared buffers, spilled to temporary files, wrote WAL, compiled with JIT). None
/// where it was not called.
fn statement_counts(counters: &BTreeMap<String, f64>) -> Option<String> {
    let get = |name: &str| counters.get(name).copied().unwrap_or(0.0);
    let calls = get("calls");
    if calls < 1.0 {
        return None;
    }
    let mut parts = vec![
        format!("{calls:.0} {}", if calls == 1.0 { "call" } else { "calls" }),
        format!("{:.3} ms each", get("total_exec_time") / calls),
        format!("{:.1} rows each", get("rows") / calls),
    ];
    let plans = get("plans");
    if plans > 0.0 {
        parts.push(format!("{plans:.0} plans"));
    }
    let read = get("shared_blks_read");
    if read > 0.0 {
        parts.push(format!(
            "{read:.0} blocks read into shared buffers ({:.0} found there)",
            get("shared_blks_hit")
        ));
    }
    let temp = get("temp_blks_written");
    if temp > 0.0 {
        parts.push(format!("{temp:.0} temporary blocks written (spilled to disk)"));
    }
    let wal = get("wal_bytes");
    if wal > 0.0 {
        parts.push(format!("{} of WAL", bytes(wal)));
    }
    if get("jit_functions") > 0.0 {
        parts.push(format!("JIT: {}", jit_compiled(counters)));
    }
    Some(parts.join(", "))
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
    fn a_statement_is_quoted_with_what_pg_stat_statements_counted_over_the_trace() {
        let counters = |pairs: &[(&str, f64)]| -> BTreeMap<String, f64> {
            pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
        };
        let facts = InstanceFacts {
            pgss_deltas_by_query: BTreeMap::from([(
                "7".to_string(),
                counters(&[
                    ("calls", 200.0),
                    ("total_exec_time", 50.0),
                    ("rows", 200.0),
                    ("plans", 0.0),
                    ("shared_blks_hit", 900.0),
                    ("shared_blks_read", 0.0),
                    ("temp_blks_written", 1280.0),
                    ("wal_bytes", 0.0),
                    ("jit_functions", 0.0),
                    ("jit_generation_time", 0.0),
                ]),
            )]),
            ..InstanceFacts::default()
        };
        let mut findings = vec![
            finding("hot_function", &["tuplesort_performsort"]),
            finding("phase_dominance", &["standard_ExecutorStart"]),
        ];
        annotate(&mut findings, &facts);
        let number =
            |f: &Finding, what: &str| f.numbers.iter().find(|(w, _)| w == what).map(|(_, v)| v.clone());
        assert_eq!(
            number(&findings[0], "pg_stat_statements over the trace").as_deref(),
            Some("200 calls, 0.250 ms each, 1.0 rows each, 1280 temporary blocks written (spilled to disk)")
        );
        assert_eq!(
            number(&findings[1], "JIT over the trace (pg_stat_statements)").as_deref(),
            Some("nothing compiled (jit_functions 0): not JIT")
        );
        let compiled = counters(&[
            ("jit_functions", 12.0),
            ("jit_generation_time", 1.5),
            ("jit_emission_time", 20.0),
        ]);
        assert_eq!(
            jit_compiled(&compiled),
            "12 functions compiled, 21.5 ms compiling"
        );
        assert_eq!(
            (bytes(512.0), bytes(12_595.2), bytes(4.7 * 1048576.0)),
            ("512 B".to_string(), "12.3 KiB".to_string(), "4.7 MiB".to_string())
        );
        // A statement not called over the trace, or not read: nothing quoted.
        assert_eq!(statement_counts(&counters(&[("calls", 0.0)])), None);
        let mut unread = vec![finding("top_cpu", &[])];
        annotate(&mut unread, &InstanceFacts::default());
        assert!(unread[0].numbers.is_empty());
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
            ..InstanceFacts::default()
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
            vec![(
                "pg_stat_statements.track_planning".to_string(),
                "on (pgscope's own session; the statement's backends were not read)".to_string()
            )]
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
            ..InstanceFacts::default()
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

    /// track_planning is resolved per (database, role) of the statement's backends and quoted
    /// with its source; jit as their memory had it.
    #[test]
    fn track_planning_and_jit_are_quoted_as_the_statements_backends_ran_them() {
        use crate::postgres::sql::{SessionSamples, SessionSetting};
        let session = |database, role, samples| SessionSamples {
            database,
            role,
            samples,
        };
        let setting = |role, value, source: &str| SessionSetting {
            database: 16384,
            role,
            value,
            source: source.into(),
        };
        let facts = InstanceFacts {
            track_planning: Some(false),
            sessions_by_query: BTreeMap::from([
                ("7".to_string(), vec![session(16384, 16385, 90)]),
                (
                    "8".to_string(),
                    vec![session(16384, 16385, 25), session(16384, 10, 75)],
                ),
                ("9".to_string(), vec![session(16384, 99, 5)]),
            ]),
            track_planning_by_session: vec![
                setting(16385, Some(true), "ALTER ROLE app SET"),
                setting(10, Some(false), "server setting"),
                setting(99, None, "server setting not readable"),
            ],
            jit_by_query: BTreeMap::from([
                ("7".to_string(), BTreeMap::from([("on".to_string(), 4)])),
                (
                    "8".to_string(),
                    BTreeMap::from([("off".to_string(), 1), ("on".to_string(), 3)]),
                ),
            ]),
            ..InstanceFacts::default()
        };
        let quoted = |kind: &'static str, frames: &[&str], query_id: i64, what: &str| {
            let mut found = vec![Finding {
                query_ids: vec![QueryId(query_id)],
                ..finding(kind, frames)
            }];
            annotate(&mut found, &facts);
            found[0]
                .numbers
                .iter()
                .find(|(k, _)| k == what)
                .map(|(_, v)| v.clone())
        };
        let planning = |query_id| {
            quoted(
                "spin_site",
                &["pgss_store"],
                query_id,
                "pg_stat_statements.track_planning",
            )
        };
        assert_eq!(
            planning(7).as_deref(),
            Some("on (ALTER ROLE app SET, as the statement's backends ran)")
        );
        assert_eq!(
            planning(8).as_deref(),
            Some(
                "off (server setting) in 75% of its samples, on (ALTER ROLE app SET) in 25% of its \
                 samples (the statement's backends differ)"
            )
        );
        assert_eq!(
            planning(9).as_deref(),
            Some("unknown (server setting not readable, as the statement's backends ran)")
        );
        assert_eq!(
            planning(10).as_deref(),
            Some("off (pgscope's own session; the statement's backends were not read)")
        );
        // Evictions are the whole instance's: every sampled backend counts.
        let mut evictions = vec![Finding {
            query_ids: Vec::new(),
            ..finding("pgss_evictions", &["pgss_store", "entry_dealloc"])
        }];
        annotate(&mut evictions, &facts);
        let quoted_for_instance = evictions[0]
            .numbers
            .iter()
            .find(|(k, _)| k == "pg_stat_statements.track_planning")
            .map(|(_, v)| v.as_str());
        assert!(
            quoted_for_instance.is_some_and(|v| v.contains("on (ALTER ROLE app SET) in 59%")),
            "{quoted_for_instance:?}"
        );
        let jit = |query_id| {
            quoted(
                "phase_dominance",
                &["PortalStart", "standard_ExecutorStart"],
                query_id,
                "jit",
            )
        };
        assert_eq!(jit(7).as_deref(), Some("on (as the statement's backends ran it)"));
        assert_eq!(
            jit(8).as_deref(),
            Some("off in 25% of its samples, on in 75% of its samples (the statement's backends differ)")
        );
        assert_eq!(jit(9), None);
        assert_eq!(quoted("phase_dominance", &["PortalDrop"], 7, "jit"), None);
        // A statement compiling with JIT is told the setting it ran with.
        assert_eq!(
            quoted("jit_compilation", &[], 7, "jit").as_deref(),
            Some("on (as the statement's backends ran it)")
        );
    }

    #[test]
    fn a_stray_value_is_not_quoted_as_a_difference() {
        let facts = InstanceFacts {
            plan_cache_modes_by_query: BTreeMap::from([(
                "7".to_string(),
                BTreeMap::from([("force_generic_plan".to_string(), 999), ("auto".to_string(), 1)]),
            )]),
            ..InstanceFacts::default()
        };
        let (shown, mode) = plan_cache_mode_of(&[QueryId(7)], &facts);
        assert_eq!(shown, "force_generic_plan (as the statement's backends ran it)");
        assert_eq!(mode, "force_generic_plan");
        let split = InstanceFacts {
            plan_cache_modes_by_query: BTreeMap::from([(
                "7".to_string(),
                BTreeMap::from([("force_generic_plan".to_string(), 90), ("auto".to_string(), 10)]),
            )]),
            ..InstanceFacts::default()
        };
        assert!(plan_cache_mode_of(&[QueryId(7)], &split).0.contains("differ"));
    }
}
