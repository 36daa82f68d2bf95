//! `--probes`: per-call statistics of chosen Postgres functions, attached at the start of a
//! trace and read back at its end, per function and per (queryid, function).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::bpf::abi::{CallKey, CallStats, Function, RelationLockKey};
use crate::bpf::OnCpuProbes;

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

/// The postgres executable of `pid`, as seen from the host (through /proc/PID/root, so that
/// processes in containers are covered).
fn executable_of(pid: u32) -> Result<PathBuf> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("cannot resolve the executable of PID {pid}"))?;
    let relative = exe.strip_prefix("/").unwrap_or(&exe);
    Ok(PathBuf::from(format!("/proc/{pid}/root")).join(relative))
}

/// Attaches what can be attached and says, per function, what could not and why; the trace
/// goes on with the others. Returns the functions attached.
pub fn attach(probes: &mut OnCpuProbes, functions: &[Function], pid: u32) -> Result<Vec<Function>> {
    if functions.is_empty() {
        return Ok(Vec::new());
    }
    let executable = executable_of(pid)?;
    let mut attached = Vec::new();
    for &function in functions {
        if function == Function::PgssStore {
            eprintln!(
                "pgscope: probe pgss_store not attached: it is a static function of \
                 pg_stat_statements.so, whose distro build has no symbol table; pgscope cannot \
                 resolve it yet (debug files and hook discovery are planned)"
            );
            continue;
        }
        match probes.attach_function(function, &executable) {
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

    /// Statistics per function over all backends and queries.
    pub fn by_function(&self) -> BTreeMap<Function, CallStats> {
        let mut out: BTreeMap<Function, CallStats> =
            self.attached.iter().map(|&f| (f, CallStats::default())).collect();
        for (key, stats) in &self.calls {
            if let Some(function) = Function::from_cookie(key.function) {
                out.entry(function).or_default().merge(stats);
            }
        }
        out
    }

    /// Statistics per (queryid, function) over all backends, by total time, longest first.
    pub fn by_query(&self) -> Vec<((i64, Function), CallStats)> {
        let mut merged: BTreeMap<(i64, Function), CallStats> = BTreeMap::new();
        for (key, stats) in &self.calls {
            if let Some(function) = Function::from_cookie(key.function) {
                merged
                    .entry((key.query_id as i64, function))
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
    for (function, stats) in results.by_function() {
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
            function.name(),
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
        for ((query_id, function), stats) in by_query.iter().take(limit) {
            let avg = if stats.calls == 0 {
                0.0
            } else {
                micros(stats.total_ns) / stats.calls as f64
            };
            let _ = writeln!(
                out,
                "{:>21} {:<24} {:>10} {:>11.2} {:>9.2}",
                query_id,
                function.name(),
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
        assert_eq!(by_function[&Function::LockRelationOid].calls, 8);
        assert_eq!(
            by_function[&Function::BtGetroot].calls,
            0,
            "attached but never called"
        );
        let by_query = results.by_query();
        assert_eq!(by_query[0], ((7, Function::LockRelationOid), stats(7)));
        assert_eq!(results.locks_by_relation(), vec![((7, 16384, 1), 7)]);
        let table = render(&results, 1.0, 10);
        assert!(table.contains("AccessShareLock"), "{table}");
    }
}
