//! Rules over on-CPU stacks per queryid: where each statement's CPU goes by phase and through
//! which Postgres functions.

use std::collections::BTreeMap;

use super::{percent, Finding, Severity, StatementCause};
use crate::model::hot_paths::{cited_frames, path_text, TRUNK_SHARE};
use crate::model::StatementCpu;
use crate::postgres::phase::Phase;
use crate::postgres::subsystems;
use exporters::PathStep;

/// A query needs this many samples before a share of them means anything.
pub(super) const MIN_SAMPLES: u64 = 20;

/// Queries a per-statement rule can speak of: queryid 0 is not a statement but "not computed
/// yet" — every statement's parsing runs before its queryid is set.
pub(super) fn statements(queries: &[StatementCpu]) -> impl Iterator<Item = &StatementCpu> {
    queries
        .iter()
        .filter(|q| q.query_id.is_statement() && q.samples >= MIN_SAMPLES)
}
/// The share of a statement's samples the function a top consumer's finding names holds at
/// least, where its hottest path has one: most of its time.
const HALF: f64 = 0.5;
/// Top CPU consumers named, always (those with at least `TOP_MIN_SHARE` of the samples).
const TOP: usize = 3;
const TOP_MIN_SHARE: f64 = 0.01;
/// Planning (parse, analysis, plan) at least this share of a statement's CPU: more than the
/// shortest statements spend, and invisible to pg_stat_statements by default. A custom plan
/// over 64 partitions spends 42-48% (measured here).
const PLANNING_WARN: f64 = 0.40;
const PLANNING_CRITICAL: f64 = 0.65;
/// What the shortest statements spend planning: pgbench's under the simple protocol 31-36%
/// (measured here). A few dozen samples of one can read 50%, so the samples must show more
/// than this with 95% confidence.
const PLANNING_USUAL: f64 = 1.0 / 3.0;
/// Planning a prepared (cached) statement again, at least this share of its CPU: a prepared
/// statement is meant to be planned once, so planning that runs under `GetCachedPlan` at every
/// execution (custom plans) is worth naming well below [`PLANNING_WARN`]. A custom plan over 64
/// partitions spends 35-40% in the planner (measured here, without probes); a generic plan
/// plans its first executions only.
const REPLANNING_WARN: f64 = 0.25;
/// The share re-planning must show with 95% confidence: more than a fifth.
const REPLANNING_USUAL: f64 = 0.20;
/// One-sided 95% normal quantile, for the lower bound of a share of samples.
const Z_95: f64 = 1.645;

/// The lower end of the one-sided 95% Wilson interval of `hits` out of `n` samples: a share
/// the samples support, not just show. Few samples give a low bound whatever they show.
pub(super) fn supported_share(hits: u64, n: u64) -> f64 {
    if n == 0 {
        return 0.0;
    }
    let (n, p) = (n as f64, hits as f64 / n as f64);
    let z2 = Z_95 * Z_95;
    let centre = p + z2 / (2.0 * n);
    let margin = Z_95 * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre - margin) / (1.0 + z2 / n)).max(0.0)
}
/// Spinning at least this share of a query's (or all) CPU.
const SPIN_WARN: f64 = 0.05;
const SPIN_CRITICAL: f64 = 0.20;

/// The queries that use the most CPU, with the phase most of it is in: always reported. Where
/// a finding of `found` already names a statement's cause, its line says no more than its
/// share and phase: the cause is counted once, in that finding.
pub fn top_consumers(queries: &[StatementCpu], total: u64, found: &[Finding]) -> Vec<Finding> {
    if total == 0 {
        return Vec::new();
    }
    queries
        .iter()
        .filter(|q| q.query_id.is_statement() && q.samples as f64 / total as f64 >= TOP_MIN_SHARE)
        .take(TOP)
        .map(|q| {
            let share = q.samples as f64 / total as f64;
            let mut numbers = vec![
                ("share of the CPU samples".to_string(), percent(share)),
                ("samples".to_string(), q.samples.to_string()),
            ];
            if let Some((phase, phase_share)) = q.dominant_phase() {
                numbers.push((format!("in {}", phase.label()), percent(phase_share)));
            }
            // Where: on its largest hot path, the deepest function that holds at least half of
            // its samples (the path's last when none does). Not a frame every sample runs
            // under: its time spreads from there.
            let share_of = |step: &PathStep| step.count as f64 / q.samples as f64;
            let explained = found
                .iter()
                .any(|f| f.cause.is_some() && f.query_ids.contains(&q.query_id));
            let hot = q.hot_paths.first().filter(|_| !explained).and_then(|path| {
                let beyond_trunk = |step: &&PathStep| share_of(step) < TRUNK_SHARE;
                let half = path
                    .steps
                    .iter()
                    .rev()
                    .filter(beyond_trunk)
                    .find(|step| share_of(step) >= HALF);
                let step = half.or(path.steps.last().filter(beyond_trunk))?;
                Some((path, step))
            });
            let mut title = format!(
                "queryid {} uses {} of the CPU sampled",
                q.query_id,
                percent(share)
            );
            let mut frames = Vec::new();
            if let Some((path, last)) = hot {
                let under = last.count as f64 / q.samples as f64;
                let module = match last.frame.module.as_deref() {
                    Some(module) if module != "postgres" => format!(" in {module}"),
                    _ => String::new(),
                };
                title.push_str(&format!(
                    ", {} of it under {}{module}",
                    percent(under),
                    exporters::sanitize(&last.frame.name)
                ));
                numbers.push(("its hottest path".to_string(), path_text(path, q.samples)));
                frames = cited_frames(path, q.samples);
                // The part of Postgres most of its time is in, where one holds a quarter of
                // it: the function above names where, the family what it does and why.
                if let Some((subsystem, in_it)) = main_subsystem(q) {
                    numbers.push((
                        format!("part of Postgres ({} of its samples)", percent(in_it)),
                        subsystem.what.to_string(),
                    ));
                    numbers.push((
                        "what usually makes it costly".to_string(),
                        subsystem.usual_causes.to_string(),
                    ));
                    numbers.push(("what confirms it".to_string(), subsystem.confirmed_by.to_string()));
                }
            }
            Finding {
                kind: "top_cpu",
                severity: Severity::Info,
                title,
                numbers,
                query_ids: vec![q.query_id],
                frames,
                action:
                    "the flamegraph filtered on this queryid shows where; pg_stat_statements has its text"
                        .into(),
                cause: None,
            }
        })
        .collect()
}

/// A subsystem holding this share of a statement's samples is named with it by `top_cpu`.
const SUBSYSTEM_NAMED: f64 = 0.25;

/// The subsystem (`postgres::subsystems`) with most of `q`'s samples, and its share, where it
/// holds [`SUBSYSTEM_NAMED`] of them.
fn main_subsystem(q: &StatementCpu) -> Option<(&'static subsystems::Subsystem, f64)> {
    let (name, samples) = q
        .subsystems
        .iter()
        .max_by_key(|(name, samples)| (**samples, std::cmp::Reverse(**name)))?;
    let share = *samples as f64 / q.samples as f64;
    let subsystem = subsystems::ALL.iter().copied().find(|s| s.name == *name)?;
    (share >= SUBSYSTEM_NAMED).then_some((subsystem, share))
}

/// Statements whose CPU goes mostly to parse, analysis and planning: pg_stat_statements times
/// execution only (planning with track_planning, off by default; parsing never).
pub fn planning_dominated(queries: &[StatementCpu], period_ns: u64) -> Vec<Finding> {
    statements(queries)
        .filter_map(|q| {
            let parse = q.phase(Phase::Parse) + q.phase(Phase::Analyze);
            // The planner's own frames, or the plan phase less a cached plan's relation locking
            // where that is more: a custom plan's planning also runs outside them (and, with
            // function probes on, their traps land beside them), while a generic plan's plan
            // phase is mostly locking, which is not planning.
            let plan = q
                .planner
                .max(q.phase(Phase::Plan).saturating_sub(q.plan_locking));
            let share = (parse + plan) as f64 / q.samples as f64;
            let supported = supported_share(parse + plan, q.samples);
            let replanning = q.replanning as f64 / q.samples as f64;
            let replans = replanning >= REPLANNING_WARN
                && supported_share(q.replanning, q.samples) > REPLANNING_USUAL;
            let named = (share >= PLANNING_WARN && supported > PLANNING_USUAL) || replans;
            named.then(|| Finding {
                kind: "planning_dominated",
                severity: Severity::warning_or_critical(share, PLANNING_CRITICAL),
                title: format!(
                    "queryid {} spends {} of its CPU parsing and planning, which pg_stat_statements does not time by default",
                    q.query_id,
                    percent(share)
                ),
                numbers: [
                    ("parse + analysis".to_string(), percent(parse as f64 / q.samples as f64)),
                    ("planning".to_string(), percent(plan as f64 / q.samples as f64)),
                ]
                .into_iter()
                .chain(replans.then(|| {
                    (
                        "planning a prepared statement again (under GetCachedPlan)".to_string(),
                        percent(replanning),
                    )
                }))
                .chain(std::iter::once(("samples".to_string(), q.samples.to_string())))
                .collect(),
                query_ids: vec![q.query_id],
                frames: vec!["pg_parse_query".into(), "parse_analyze".into(), "standard_planner".into()],
                action: if replans {
                    "it is prepared, yet planned again at every execution: custom plans \
                     (plan_cache_mode = force_custom_plan, or custom plans estimated cheaper than \
                     the generic one in `auto`), or a plan invalidated each time (DDL, ANALYZE, \
                     search_path changes); plan_cache_mode = force_generic_plan for this statement \
                     plans once, where run-time pruning serves it as well; \
                     pg_stat_statements.track_planning = on shows planning time there"
                } else {
                    "run it as a prepared statement (extended protocol or PREPARE) so that parsing and \
                     planning happen once per session; if it is prepared already and still plans every \
                     time, check plan_cache_mode and whether custom plans keep winning; \
                     pg_stat_statements.track_planning = on shows planning time there"
                }
                .into(),
                cause: Some(StatementCause {
                    cause: "spend a large part of their CPU parsing and planning, which \
                            pg_stat_statements does not time by default"
                        .into(),
                    figures: vec![format!("{} of its CPU", percent(share))],
                    cost_ns: (parse + plan) * period_ns,
                }),
            })
        })
        .collect()
}

/// Time spinning on spinlocks, per query and over all: many backends want the same short
/// critical section at once. The caller of s_lock names the lock.
///
/// Its cost to the instance is the time spun (samples × `period_ns`), so that, like the
/// per-statement rules, it warns only when the spinning costs the instance enough
/// (`group::weigh`): one statement may spin a few percent of its own CPU on a machine whose
/// CPUs are oversubscribed (a spinlock's holder preempted, its waiters spinning; 0.8% of the
/// instance's CPU under `WalSndWakeup` in pgbench's commits beside two CPU hogs), and that is
/// not a cause to act on.
pub fn spinning(queries: &[StatementCpu], total: u64, period_ns: u64) -> Vec<Finding> {
    let mut callers: BTreeMap<String, u64> = BTreeMap::new();
    let mut spinning_queries = Vec::new();
    for q in queries {
        let spun: u64 = q.spinning.values().sum();
        for (caller, n) in &q.spinning {
            *callers.entry(caller.clone()).or_insert(0) += n;
        }
        if q.query_id.is_statement()
            && q.samples >= MIN_SAMPLES
            && spun as f64 / q.samples as f64 >= SPIN_WARN
        {
            spinning_queries.push((q.query_id, spun, spun as f64 / q.samples as f64));
        }
    }
    let spun: u64 = callers.values().sum();
    let share = if total == 0 {
        0.0
    } else {
        spun as f64 / total as f64
    };
    if spinning_queries.is_empty() && (share < SPIN_WARN || spun < MIN_SAMPLES) {
        return Vec::new();
    }
    spinning_queries.sort_by_key(|q| std::cmp::Reverse(q.1));
    let mut by_caller: Vec<(String, u64)> = callers.into_iter().collect();
    by_caller.sort_by_key(|c| std::cmp::Reverse(c.1));
    let mut numbers = vec![("share of all CPU samples in s_lock".to_string(), percent(share))];
    for (caller, n) in by_caller.iter().take(3) {
        numbers.push((
            format!("spinning under {caller}"),
            percent(*n as f64 / total.max(1) as f64),
        ));
    }
    vec![Finding {
        kind: "spinlock_contention",
        severity: Severity::warning_or_critical(share, SPIN_CRITICAL),
        title: format!(
            "{} of the CPU is spent spinning on spinlocks (s_lock)",
            percent(share)
        ),
        numbers,
        query_ids: spinning_queries.iter().map(|(id, _, _)| *id).take(5).collect(),
        frames: by_caller
            .iter()
            .take(3)
            .map(|(c, _)| format!("{c} → s_lock"))
            .collect(),
        action: "the caller names the lock (`--probes s_lock` names its file and line); a spinlock \
                 guards a few instructions, so spinning means many backends want the same one at \
                 once: fewer active backends on that object (a pooler), or less work per call; under \
                 pg_stat_statements' pgss_store it is each statement's entry, hot when one queryid runs \
                 many thousand times a second"
            .into(),
        cause: Some(StatementCause {
            cause: "spin on spinlocks".into(),
            figures: spinning_queries
                .iter()
                .take(5)
                .map(|(_, _, share)| format!("{} of its CPU", percent(*share)))
                .collect(),
            cost_ns: spun * period_ns,
        }),
    }]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::findings::tests::named;
    use crate::model::fixtures::{profile, sample};
    use crate::model::statements::statements as table;
    use crate::model::QueryId;

    #[test]
    fn a_prepared_statement_planned_again_at_every_execution_is_named_earlier() {
        let cached = [
            "PostgresMain",
            "GetCachedPlan",
            "BuildCachedPlan",
            "pg_plan_queries",
            "planner",
        ];
        let p = profile(vec![
            // Prepared, planned under GetCachedPlan in 32% of its CPU: custom plans.
            sample(7, "plan", &cached, 320),
            sample(7, "run", &["PostgresMain", "PortalRun"], 380),
            sample(7, "other", &["PostgresMain", "__send"], 300),
            // The same share planned under the simple protocol: what short statements spend.
            sample(8, "plan", &["PostgresMain", "pg_plan_queries", "planner"], 320),
            sample(8, "run", &["PostgresMain", "PortalRun"], 680),
        ]);
        let found = planning_dominated(&table(&p), 1);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Warning);
        assert!(
            found[0].action.starts_with("it is prepared, yet planned again"),
            "{}",
            found[0].action
        );
        assert!(found[0].numbers.iter().any(|(what, value)| what
            .starts_with("planning a prepared statement again")
            && value == "32.0%"));
        // A prepared statement re-planned in a fifth of a few dozen samples: not enough to say.
        let few = profile(vec![
            sample(9, "plan", &cached, 8),
            sample(9, "run", &["PostgresMain", "PortalRun"], 22),
        ]);
        assert!(planning_dominated(&table(&few), 1).is_empty());
    }

    #[test]
    fn planning_is_named_when_it_dominates_a_statement_and_not_otherwise() {
        let p = profile(vec![
            sample(
                7,
                "plan",
                &["PostgresMain", "pg_plan_queries", "planner", "standard_planner"],
                600,
            ),
            sample(7, "parse", &["PostgresMain", "pg_parse_query"], 100),
            sample(7, "run", &["PostgresMain", "PortalRun"], 300),
            // 45% of a few dozen samples: not enough to say.
            sample(5, "plan", &["PostgresMain", "pg_plan_queries", "planner"], 10),
            sample(5, "run", &["PostgresMain", "PortalRun"], 12),
            // A third of a short statement's CPU parsing and planning is usual.
            sample(6, "plan", &["PostgresMain", "pg_plan_queries", "planner"], 30),
            sample(6, "parse", &["PostgresMain", "pg_parse_query"], 3),
            sample(6, "run", &["PostgresMain", "PortalRun"], 67),
            sample(8, "plan", &["PostgresMain", "pg_plan_queries", "planner"], 10),
            sample(8, "run", &["PostgresMain", "PortalRun"], 90),
            // A cached plan revalidated and locked: the plan phase, but no planning.
            sample(
                9,
                "plan",
                &["PostgresMain", "GetCachedPlan", "LockRelationOid"],
                60,
            ),
            sample(9, "run", &["PostgresMain", "PortalRun"], 40),
        ]);
        let found = planning_dominated(&table(&p), 1);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].query_ids, vec![QueryId(7)]);
        assert_eq!(found[0].severity, Severity::Critical);
        // Too few samples to say anything.
        let few = profile(vec![sample(9, "plan", &["pg_plan_queries", "planner"], 5)]);
        assert!(planning_dominated(&table(&few), 1).is_empty());
        // Queryid 0: parsing before any queryid is known, not a statement.
        let unknown = profile(vec![sample(0, "parse", &["pg_parse_query", "raw_parser"], 100)]);
        assert!(planning_dominated(&table(&unknown), 1).is_empty());
    }

    #[test]
    fn a_share_is_supported_by_enough_samples_only() {
        // 40% of 60 samples may be under a third; 40% of 700 is not far below 40%.
        assert!(supported_share(24, 60) < 0.31);
        assert!(supported_share(280, 700) > 0.36);
        assert!(supported_share(700, 700) > 0.99);
        assert_eq!(supported_share(0, 0), 0.0);
        assert_eq!(supported_share(0, 100), 0.0);
    }

    #[test]
    fn spinning_names_the_caller_and_stays_silent_below_the_threshold() {
        let p = profile(vec![
            sample(7, "finish", &["PostgresMain", "pgss_store", "s_lock"], 30),
            sample(7, "run", &["PostgresMain", "PortalRun"], 70),
        ]);
        let found = spinning(&table(&p), p.total_count(), 1);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].severity, Severity::Critical);
        assert_eq!(found[0].frames, vec!["pgss_store → s_lock".to_string()]);
        let calm = profile(vec![
            sample(7, "finish", &["PostgresMain", "pgss_store", "s_lock"], 2),
            sample(7, "run", &["PostgresMain", "PortalRun"], 98),
        ]);
        assert!(spinning(&table(&calm), calm.total_count(), 1).is_empty());
    }

    #[test]
    fn spinning_that_costs_the_instance_little_is_information() {
        use crate::findings::group::{group_and_weigh, InstanceTime};
        // One statement spins 8% of its own CPU; the instance, 0.8% of its CPU.
        let p = profile(vec![
            sample(7, "commit", &["PostgresMain", "WalSndWakeup", "s_lock"], 8),
            sample(7, "commit", &["PostgresMain", "CommitTransactionCommand"], 92),
            sample(8, "run", &["PostgresMain", "PortalRun"], 900),
        ]);
        let period_ns = 10_000_000;
        let found = spinning(&table(&p), p.total_count(), period_ns);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].severity, Severity::Warning);
        let instance = InstanceTime {
            backend_ns: p.total_count() * period_ns,
            seconds: 10.0,
        };
        let weighed = group_and_weigh(found, instance, |_| None);
        assert_eq!(weighed[0].severity, Severity::Info);
    }

    #[test]
    fn top_consumers_are_always_named_with_their_main_phase() {
        let p = profile(vec![
            sample(7, "run", &["PortalRun"], 60),
            sample(8, "plan", &["pg_plan_queries"], 30),
            sample(0, "run", &["PortalRun"], 10),
            // Under 1% of the samples: noise, not a consumer.
            sample(9, "run", &["PortalRun"], 0),
        ]);
        let found = top_consumers(&table(&p), p.total_count(), &[]);
        assert_eq!(named(&found), vec![QueryId(7), QueryId(8)]);
        assert!(found[0]
            .numbers
            .iter()
            .any(|(k, v)| k == "in run" && v == "100.0%"));
    }

    #[test]
    fn a_top_consumer_says_which_function_its_time_is_under_and_cites_the_path() {
        let p = profile(vec![
            sample(
                7,
                "run",
                &["PostgresMain", "PortalRun", "ExecSort", "qsort_tuple"],
                60,
            ),
            sample(7, "run", &["PostgresMain", "PortalRun", "ExecScan"], 40),
            // Spread under PostgresMain alone: no function to name.
            sample(8, "run", &["PostgresMain", "a"], 30),
            sample(8, "run", &["PostgresMain", "b"], 30),
            sample(8, "run", &["PostgresMain", "c"], 30),
        ]);
        let found = top_consumers(&table(&p), p.total_count(), &[]);
        assert_eq!(named(&found), vec![QueryId(7), QueryId(8)]);
        assert!(
            found[0]
                .title
                .ends_with("uses 52.6% of the CPU sampled, 60.0% of it under qsort_tuple"),
            "{}",
            found[0].title
        );
        assert_eq!(found[0].frames, ["PortalRun", "ExecSort", "qsort_tuple"]);
        assert!(
            found[1]
                .title
                .ends_with("of the CPU sampled, 33.3% of it under a"),
            "{}",
            found[1].title
        );
    }

    #[test]
    fn a_top_consumer_whose_cause_is_named_elsewhere_says_only_its_share() {
        let p = profile(vec![sample(
            7,
            "run",
            &[
                "PostgresMain",
                "vacuum",
                "vac_update_datfrozenxid",
                "systable_getnext",
            ],
            60,
        )]);
        let cause = Finding {
            kind: "function_dominates",
            severity: Severity::Critical,
            title: "VACUUM statements spend most of their CPU time in vac_update_datfrozenxid".into(),
            numbers: Vec::new(),
            query_ids: vec![QueryId(7)],
            frames: vec!["vac_update_datfrozenxid".into()],
            action: String::new(),
            cause: Some(StatementCause {
                cause: "spend most of their CPU time in vac_update_datfrozenxid".into(),
                figures: Vec::new(),
                cost_ns: 1,
            }),
        };
        let found = top_consumers(&table(&p), p.total_count(), &[cause]);
        assert_eq!(named(&found), vec![QueryId(7)]);
        assert!(
            found[0].title.ends_with("uses 100.0% of the CPU sampled"),
            "{}",
            found[0].title
        );
        assert!(found[0].frames.is_empty(), "{:?}", found[0].frames);
    }
}
