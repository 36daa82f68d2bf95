//! `--probes`: per-call statistics of chosen Postgres functions, attached at the start of a
//! trace and read back at its end, per function and per (queryid, function).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};

use crate::bpf::abi::{CallKey, CallStats, Function, ProbedCall, RelationLockKey};

/// `ProbedCall::detail` of pgss_store's exec call (PGSS_EXEC + 2).
const PGSS_EXEC: u32 = 3;
use crate::bpf::OnCpuProbes;
use symbolizer::{FindFunctionError, Symbolizer};

/// Parses one `--probes` item: a function name, or `all`.
pub fn parse_probe_list(items: &[String]) -> Result<Vec<Function>> {
    let mut functions = Vec::new();
    for item in items {
        if item == "all" {
            functions.extend(Function::ALL);
            continue;
        }
        match Function::ALL.into_iter().find(|f| f.name() == item) {
            Some(function) => functions.push(function),
            None => bail!(
                "unknown probe `{item}`: choose from {} or `all`",
                Function::ALL.map(|f| f.name()).join(", ")
            ),
        }
    }
    functions.sort();
    functions.dedup();
    Ok(functions)
}

/// The file a function lives in: pg_stat_statements' functions in its library, the others in
/// the postgres executable.
fn module_of(function: Function, executable: &str) -> String {
    match function {
        Function::PgssStore => "pg_stat_statements.so".to_string(),
        _ => executable.to_string(),
    }
}

/// What to do when a function cannot be found, in one sentence.
fn explain(function: Function, error: &FindFunctionError) -> String {
    match (function, error) {
        (Function::PgssStore, FindFunctionError::ModuleNotMapped { .. }) => {
            "pg_stat_statements is not loaded in this instance (add it to shared_preload_libraries)".into()
        }
        (Function::PgssStore, FindFunctionError::NoSymbol { path, .. }) => format!(
            "pgss_store is a static function of `{}`, which is stripped, and no debug file was found: \
             install the debug package (postgresql-15-dbgsym from the debian-debug archive) or pass \
             --debug-dir with a .build-id tree that holds it",
            path.display()
        ),
        (_, error) => error.to_string(),
    }
}

/// Attaches what can be attached and says, per function, what could not and why; the trace
/// goes on with the others. Functions are found with the symbolizer's symbol tables, so static
/// functions of stripped files count when their debug file is installed. Returns the functions
/// attached.
pub fn attach(
    probes: &mut OnCpuProbes,
    symbolizer: &mut Symbolizer,
    functions: &[Function],
    pid: u32,
) -> Result<Vec<Function>> {
    if functions.is_empty() {
        return Ok(Vec::new());
    }
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("cannot resolve the executable of PID {pid}"))?;
    let executable = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut attached = Vec::new();
    for &function in functions {
        let location = match symbolizer.find_function(pid, &module_of(function, &executable), function.name())
        {
            Ok(location) => location,
            Err(error) => {
                eprintln!(
                    "pgscope: probe {} not attached: {}",
                    function.name(),
                    explain(function, &error)
                );
                continue;
            }
        };
        match probes.attach_function(function, &location.path, location.file_offset) {
            Ok(()) => attached.push(function),
            Err(error) => eprintln!("pgscope: probe {} not attached: {error:#}", function.name()),
        }
    }
    Ok(attached)
}

/// What the probes measured, read from the kernel before the programs are detached.
#[derive(Debug, Default)]
pub struct ProbeResults {
    pub attached: Vec<Function>,
    pub calls: Vec<(CallKey, CallStats)>,
    pub relation_locks: Vec<(RelationLockKey, u64)>,
}

impl ProbeResults {
    pub fn collect(probes: &OnCpuProbes, attached: Vec<Function>) -> Result<Self> {
        if attached.is_empty() {
            return Ok(Self::default());
        }
        Ok(Self {
            attached,
            calls: probes.call_stats()?,
            relation_locks: probes.relation_locks()?,
        })
    }

    /// Statistics per function (pgss_store per kind) over all backends and queries; functions
    /// attached but never called are listed with zero calls.
    pub fn by_function(&self) -> BTreeMap<ProbedCall, CallStats> {
        let mut out: BTreeMap<ProbedCall, CallStats> = self
            .attached
            .iter()
            .map(|&function| {
                let detail = if function == Function::PgssStore {
                    PGSS_EXEC
                } else {
                    0
                };
                (ProbedCall { function, detail }, CallStats::default())
            })
            .collect();
        for (key, stats) in &self.calls {
            if let Some(call) = ProbedCall::from_key(key) {
                out.entry(call).or_default().merge(stats);
            }
        }
        out
    }

    /// Statistics per (queryid, function) over all backends, by total time, longest first.
    pub fn by_query(&self) -> Vec<((i64, ProbedCall), CallStats)> {
        let mut merged: BTreeMap<(i64, ProbedCall), CallStats> = BTreeMap::new();
        for (key, stats) in &self.calls {
            if let Some(call) = ProbedCall::from_key(key) {
                merged
                    .entry((key.query_id as i64, call))
                    .or_default()
                    .merge(stats);
            }
        }
        let mut rows: Vec<_> = merged.into_iter().collect();
        rows.sort_by(|a, b| b.1.total_ns.cmp(&a.1.total_ns).then(a.0.cmp(&b.0)));
        rows
    }

    /// LockRelationOid calls per (queryid, relation, mode) over all backends, most first.
    pub fn locks_by_relation(&self) -> Vec<((i64, u32, u32), u64)> {
        let mut merged: BTreeMap<(i64, u32, u32), u64> = BTreeMap::new();
        for (key, calls) in &self.relation_locks {
            *merged
                .entry((key.query_id as i64, key.relid, key.lockmode))
                .or_insert(0) += calls;
        }
        let mut rows: Vec<_> = merged.into_iter().collect();
        rows.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        rows
    }
}

/// `LOCKMODE` names (storage/lockdefs.h, stable since 8.x).
pub fn lock_mode_name(mode: u32) -> &'static str {
    match mode {
        1 => "AccessShareLock",
        2 => "RowShareLock",
        3 => "RowExclusiveLock",
        4 => "ShareUpdateExclusiveLock",
        5 => "ShareLock",
        6 => "ShareRowExclusiveLock",
        7 => "ExclusiveLock",
        8 => "AccessExclusiveLock",
        _ => "unknown lock mode",
    }
}

fn micros(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// The probe tables of the summary: per function, per (queryid, function), relations locked.
pub fn render(results: &ProbeResults, seconds: f64, limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>10} {:>10} {:>11} {:>9} {:>9} {:>9} {:>10}",
        "function", "calls", "calls/s", "total ms", "avg µs", "p50 µs≤", "p99 µs≤", "max µs"
    );
    for (call, stats) in results.by_function() {
        let avg = if stats.calls == 0 {
            0.0
        } else {
            micros(stats.total_ns) / stats.calls as f64
        };
        let quantile = |q| {
            stats
                .quantile_upper_ns(q)
                .map(|ns| format!("{:.1}", micros(ns)))
                .unwrap_or("-".into())
        };
        let _ = writeln!(
            out,
            "{:<24} {:>10} {:>10.0} {:>11.2} {:>9.2} {:>9} {:>9} {:>10.1}",
            call.label(),
            stats.calls,
            stats.calls as f64 / seconds.max(1e-9),
            stats.total_ns as f64 / 1e6,
            avg,
            quantile(0.5),
            quantile(0.99),
            micros(stats.max_ns)
        );
    }
    let by_query = results.by_query();
    if !by_query.is_empty() {
        let _ = writeln!(out, "\nprobed functions by query (longest total first):");
        let _ = writeln!(
            out,
            "{:>21} {:<24} {:>10} {:>11} {:>9}",
            "queryid", "function", "calls", "total ms", "avg µs"
        );
        for ((query_id, call), stats) in by_query.iter().take(limit) {
            let avg = if stats.calls == 0 {
                0.0
            } else {
                micros(stats.total_ns) / stats.calls as f64
            };
            let _ = writeln!(
                out,
                "{:>21} {:<24} {:>10} {:>11.2} {:>9.2}",
                query_id,
                call.label(),
                stats.calls,
                stats.total_ns as f64 / 1e6,
                avg
            );
        }
    }
    let locks = results.locks_by_relation();
    if !locks.is_empty() {
        let _ = writeln!(
            out,
            "\nrelations locked by LockRelationOid (name them with `SELECT <relid>::regclass`):"
        );
        let _ = writeln!(
            out,
            "{:>21} {:>10} {:<26} {:>10}",
            "queryid", "relid", "mode", "calls"
        );
        for ((query_id, relid, mode), calls) in locks.iter().take(limit) {
            let _ = writeln!(
                out,
                "{:>21} {:>10} {:<26} {:>10}",
                query_id,
                relid,
                lock_mode_name(*mode),
                calls
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_list_accepts_names_and_all() {
        let parsed = parse_probe_list(&["LockRelationOid".into(), "_bt_getroot".into()]).expect("valid");
        assert_eq!(parsed, vec![Function::LockRelationOid, Function::BtGetroot]);
        assert_eq!(
            parse_probe_list(&["all".into()]).expect("valid").len(),
            Function::ALL.len()
        );
        let err = parse_probe_list(&["LockRelation".into()]).expect_err("unknown");
        assert!(err.to_string().contains("LockRelationOid"), "{err}");
    }

    #[test]
    fn results_merge_backends_per_query() {
        let key = |tgid, query_id| CallKey {
            tgid,
            function: Function::LockRelationOid as u32,
            query_id,
        };
        let stats = |calls| CallStats {
            calls,
            total_ns: calls * 1000,
            max_ns: 1000,
            ..Default::default()
        };
        let results = ProbeResults {
            attached: vec![Function::LockRelationOid, Function::BtGetroot],
            calls: vec![
                (key(1, 7), stats(3)),
                (key(2, 7), stats(4)),
                (key(1, 9), stats(1)),
            ],
            relation_locks: vec![
                (
                    RelationLockKey {
                        tgid: 1,
                        relid: 16384,
                        query_id: 7,
                        lockmode: 1,
                        _pad: 0,
                    },
                    5,
                ),
                (
                    RelationLockKey {
                        tgid: 2,
                        relid: 16384,
                        query_id: 7,
                        lockmode: 1,
                        _pad: 0,
                    },
                    2,
                ),
            ],
        };
        let by_function = results.by_function();
        let lock = ProbedCall {
            function: Function::LockRelationOid,
            detail: 0,
        };
        assert_eq!(by_function[&lock].calls, 8);
        assert_eq!(
            by_function[&ProbedCall {
                function: Function::BtGetroot,
                detail: 0
            }]
                .calls,
            0,
            "attached but never called"
        );
        let by_query = results.by_query();
        assert_eq!(by_query[0], ((7, lock), stats(7)));
        assert_eq!(results.locks_by_relation(), vec![((7, 16384, 1), 7)]);
        let table = render(&results, 1.0, 10);
        assert!(table.contains("AccessShareLock"), "{table}");
    }
}
