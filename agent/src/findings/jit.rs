//! Statements that spend their time compiling rather than running: JIT compiles a plan's
//! expressions with LLVM at every execution whose estimated cost passes `jit_above_cost`
//! (inlining and optimizing past their own thresholds), which pays only when the plan then
//! runs long over many rows. Named where a statement's CPU is under LLVM's functions and its
//! pg_stat_statements counters show JIT compiled for it over the trace.

use super::counted::{per_statement, Deltas};
use super::cpu::supported_share;
use super::{percent, Finding, Severity, StatementCause};
use crate::model::StatementCpu;
use crate::postgres::sql::InstanceFacts;
use crate::postgres::subsystems::JIT;

/// JIT's share of a statement's CPU from which compiling is worth acting on: a quarter of a
/// statement spent producing code, rather than running it, is time it would have without JIT.
/// Half of it is a critical share.
const JIT_WARN: f64 = 0.25;
const JIT_CRITICAL: f64 = 0.50;
/// The share the samples must support with 95% confidence.
const JIT_SUPPORTED: f64 = 0.15;

/// The statements of `queries` with [`JIT_WARN`] of their CPU under LLVM and JIT compilation
/// in their pg_stat_statements counters (`facts`) over the trace.
pub fn jit_compilation(
    queries: &[StatementCpu],
    facts: Option<&InstanceFacts>,
    period_ns: u64,
) -> Vec<Finding> {
    per_statement(queries, facts, |q, counters| compiling(q, counters, period_ns))
}

/// The finding for statement `q`, given its counters' growth over the trace.
fn compiling(q: &StatementCpu, counters: Deltas<'_>, period_ns: u64) -> Option<Finding> {
    let get = |name: &str| counters.get(name);
    let (calls, functions) = (get("calls"), get("jit_functions"));
    if calls < 1.0 || functions <= 0.0 {
        return None;
    }
    let samples = q.in_subsystem(&JIT);
    let share = samples as f64 / q.samples as f64;
    if share < JIT_WARN || supported_share(samples, q.samples) < JIT_SUPPORTED {
        return None;
    }
    let jit_ms: f64 = counters
        .all()
        .filter(|(name, _)| name.starts_with("jit_") && name.ends_with("_time"))
        .map(|(_, ms)| ms)
        .sum();
    let exec_ms = get("total_exec_time");
    let per_call = |ms: f64| format!("{:.1} ms", ms / calls);
    let mut numbers = vec![
        (format!("CPU under {}", JIT.what), percent(share)),
        ("JIT time per call (pg_stat_statements)".into(), per_call(jit_ms)),
        (
            "execution time per call (pg_stat_statements)".into(),
            per_call(exec_ms),
        ),
        (
            "functions compiled per call".into(),
            format!("{:.1}", functions / calls),
        ),
    ];
    for phase in ["inlining", "optimization"] {
        let ms = get(&format!("jit_{phase}_time"));
        if ms > 0.0 {
            numbers.push((format!("of which {phase}, per call"), per_call(ms)));
        }
    }
    numbers.push(("samples".into(), q.samples.to_string()));
    Some(Finding {
        kind: "jit_compilation",
        severity: Severity::warning_or_critical(share, JIT_CRITICAL),
        title: format!(
            "queryid {} spends {} of its CPU compiling its plan with JIT: {} of JIT per call \
             against {} of execution",
            q.query_id,
            percent(share),
            per_call(jit_ms),
            per_call(exec_ms)
        ),
        numbers,
        query_ids: vec![q.query_id],
        // Kept where sampled under the statement (`citations`).
        frames: vec!["jit_compile_expr".into(), "llvm_compile_expr".into()],
        action: "JIT pays for itself only on plans that run long over many rows; this one \
                 compiles at every execution for less than compiling costs. Raise \
                 jit_above_cost above this plan's estimated cost (and jit_inline_above_cost \
                 and jit_optimize_above_cost, which add the costliest parts), or SET jit = off \
                 for its role or database; a row estimate far above the real count (EXPLAIN \
                 ANALYZE) is what usually lifts a plan's cost over the thresholds"
            .into(),
        cause: Some(StatementCause {
            cause: "compile their plans with JIT at every execution, for more than it saves".into(),
            figures: vec![format!(
                "{} of its CPU, {} of JIT per call",
                percent(share),
                per_call(jit_ms)
            )],
            cost_ns: samples * period_ns,
        }),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::model::QueryId;

    fn statement(jit_samples: u64) -> StatementCpu {
        StatementCpu {
            query_id: QueryId(7),
            samples: 200,
            subsystems: BTreeMap::from([("jit", jit_samples)]),
            ..StatementCpu::default()
        }
    }

    fn facts(jit_functions: f64) -> InstanceFacts {
        let counters = [
            ("calls", 10.0),
            ("total_exec_time", 800.0),
            ("jit_functions", jit_functions),
            ("jit_generation_time", 20.0),
            ("jit_inlining_time", 150.0),
            ("jit_optimization_time", 250.0),
            ("jit_emission_time", 80.0),
        ];
        InstanceFacts {
            pgss_deltas_by_query: BTreeMap::from([(
                "7".to_string(),
                counters.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
            )]),
            ..InstanceFacts::default()
        }
    }

    #[test]
    fn a_statement_compiling_at_every_execution_is_named_with_its_jit_time() {
        let found = jit_compilation(&[statement(120)], Some(&facts(60.0)), 10_000_000);
        assert_eq!(found.len(), 1, "{found:?}");
        let finding = &found[0];
        assert_eq!(finding.severity, Severity::Critical);
        assert!(
            finding.title.contains(
                "60.0% of its CPU compiling its plan with JIT: 50.0 ms of JIT per call against 80.0 ms"
            ),
            "{}",
            finding.title
        );
        // The advice turns JIT down, never on.
        assert!(finding.action.contains("jit = off") && !finding.action.contains("jit = on"));
        assert_eq!(finding.cause.as_ref().map(|c| c.cost_ns), Some(120 * 10_000_000));
    }

    #[test]
    fn without_compilation_counted_or_time_under_llvm_jit_is_not_named() {
        assert!(jit_compilation(&[statement(120)], Some(&facts(0.0)), 10_000_000).is_empty());
        assert!(jit_compilation(&[statement(20)], Some(&facts(60.0)), 10_000_000).is_empty());
        assert!(jit_compilation(&[statement(120)], None, 10_000_000).is_empty());
    }
}
