//! `--probes`: per-call statistics of chosen Postgres functions, read back at the end of a trace
//! and rendered per function and per (queryid, function). Attaching and the duty cycle are in
//! `collect::probes::set`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Result;

use super::spin_sites::{self, SpinSite};
use crate::bpf::abi::{CallKey, CallStats, Function, ProbedCall, RelationLockKey};
use crate::bpf::OnCpuProbes;
use crate::collect::probes::{Extrapolation, ProbeSet};

/// `ProbedCall::detail` of pgss_store's exec call (PGSS_EXEC + 2).
const PGSS_EXEC: u32 = 3;

fn scaled(stats: &CallStats, factor: f64) -> CallStats {
    let scale = |n: u64| (n as f64 * factor).round() as u64;
    let mut out = *stats;
    out.calls = scale(stats.calls);
    out.total_ns = scale(stats.total_ns);
    for bucket in out.hist.iter_mut() {
        *bucket = scale(*bucket);
    }
    out
}

/// What the probes measured, read from the kernel before the programs are detached. Counts
/// of functions that were duty-cycled are estimates for the whole trace, scaled by their
/// [`Extrapolation`].
#[derive(Debug, Default)]
pub struct ProbeResults {
    pub attached: Vec<Function>,
    pub calls: Vec<(CallKey, CallStats)>,
    pub relation_locks: Vec<(RelationLockKey, u64)>,
    /// s_lock call sites per queryid, named and scaled like the calls.
    pub spin_sites: Vec<SpinSite>,
    pub extrapolations: BTreeMap<Function, Extrapolation>,
    /// Per function: traps taken by processes that are not traced (other instances of the same
    /// executable or library). Nothing is measured for them, but they cost their processes a
    /// trap each, and count against the probe budget.
    pub foreign_hits: BTreeMap<Function, u64>,
}

impl ProbeResults {
    /// Reads the probes' maps; s_lock call-site strings are read from the calling backends,
    /// or from `target_pid` (the traced backend or postmaster) for backends gone since.
    pub fn collect(probes: &OnCpuProbes, set: &ProbeSet, trace: Duration, target_pid: u32) -> Result<Self> {
        let attached = set.functions();
        if attached.is_empty() {
            return Ok(Self::default());
        }
        let extrapolations = set.extrapolations(trace);
        let mut spin_sites = spin_sites::resolve(&probes.spin_sites()?, target_pid);
        if let Some(extrapolation) = extrapolations.get(&Function::SLock) {
            spin_sites::scale(&mut spin_sites, extrapolation.factor);
        }
        Ok(Self {
            attached,
            calls: probes.call_stats()?,
            relation_locks: probes.relation_locks()?,
            spin_sites,
            extrapolations,
            foreign_hits: set.foreign_hits(probes)?,
        })
    }

    pub fn extrapolation(&self, function: Function) -> Extrapolation {
        self.extrapolations.get(&function).copied().unwrap_or_default()
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
                let factor = self.extrapolation(call.function).factor;
                out.entry(call).or_default().merge(&scaled(stats, factor));
            }
        }
        out
    }

    /// Statistics per (queryid, function) over all backends, by total time, longest first.
    pub fn by_query(&self) -> Vec<((i64, ProbedCall), CallStats)> {
        let mut merged: BTreeMap<(i64, ProbedCall), CallStats> = BTreeMap::new();
        for (key, stats) in &self.calls {
            if let Some(call) = ProbedCall::from_key(key) {
                let factor = self.extrapolation(call.function).factor;
                merged
                    .entry((key.query_id as i64, call))
                    .or_default()
                    .merge(&scaled(stats, factor));
            }
        }
        let mut rows: Vec<_> = merged.into_iter().collect();
        rows.sort_by(|a, b| b.1.total_ns.cmp(&a.1.total_ns).then(a.0.cmp(&b.0)));
        rows
    }

    /// LockRelationOid calls per (queryid, relation, mode) over all backends, most first.
    pub fn locks_by_relation(&self) -> Vec<((i64, u32, u32), u64)> {
        let factor = self.extrapolation(Function::LockRelationOid).factor;
        let mut merged: BTreeMap<(i64, u32, u32), u64> = BTreeMap::new();
        for (key, calls) in &self.relation_locks {
            let estimate = (*calls as f64 * factor).round() as u64;
            *merged
                .entry((key.query_id as i64, key.relid, key.lockmode))
                .or_insert(0) += estimate;
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

/// "100%" for exact counts, "12% (est.)" for counts scaled up from a duty cycle.
fn attached_note(extrapolation: Extrapolation) -> String {
    let share = 100.0 * extrapolation.attached_share;
    if extrapolation.extrapolated {
        format!("{share:.0}% (est.)")
    } else {
        format!("{share:.0}%")
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
        "{:<24} {:>10} {:>10} {:>11} {:>9} {:>9} {:>9} {:>10}  attached",
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
            "{:<24} {:>10} {:>10.0} {:>11.2} {:>9.2} {:>9} {:>9} {:>10.1}  {}",
            call.label(),
            stats.calls,
            stats.calls as f64 / seconds.max(1e-9),
            stats.total_ns as f64 / 1e6,
            avg,
            quantile(0.5),
            quantile(0.99),
            micros(stats.max_ns),
            attached_note(results.extrapolation(call.function))
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
    render_foreign_hits(results, &mut out);
    spin_sites::render(&results.spin_sites, limit, &mut out);
    out
}

/// Says how often processes that are not traced trapped on the probes: a uprobe is set on the
/// file, so every instance running the same executable pays for it.
fn render_foreign_hits(results: &ProbeResults, out: &mut String) {
    let hits: Vec<String> = results
        .foreign_hits
        .iter()
        .filter(|(_, &hits)| hits > 0)
        .map(|(function, hits)| format!("{} {hits}", function.name()))
        .collect();
    if !hits.is_empty() {
        let _ = writeln!(
            out,
            "\nprocesses outside the trace that map the same files hit the probes too (not \
             measured, counted in the probe budget): {}",
            hits.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            spin_sites: Vec::new(),
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
            extrapolations: BTreeMap::new(),
            foreign_hits: BTreeMap::new(),
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
        assert!(!table.contains("outside the trace"), "{table}");
    }

    #[test]
    fn hits_outside_the_trace_are_named() {
        let results = ProbeResults {
            attached: vec![Function::PortalStart],
            foreign_hits: BTreeMap::from([(Function::PortalStart, 1234)]),
            ..Default::default()
        };
        let table = render(&results, 1.0, 10);
        assert!(
            table.contains("outside the trace") && table.contains("PortalStart 1234"),
            "{table}"
        );
    }

    #[test]
    fn duty_cycled_counts_are_scaled_and_marked() {
        let key = CallKey {
            tgid: 1,
            function: Function::LockRelationOid as u32,
            query_id: 7,
        };
        let measured = CallStats {
            calls: 100,
            total_ns: 100_000,
            max_ns: 5_000,
            ..Default::default()
        };
        let mut extrapolations = BTreeMap::new();
        extrapolations.insert(
            Function::LockRelationOid,
            Extrapolation {
                factor: 4.0,
                extrapolated: true,
                attached_share: 0.25,
            },
        );
        let results = ProbeResults {
            attached: vec![Function::LockRelationOid],
            calls: vec![(key, measured)],
            spin_sites: Vec::new(),
            relation_locks: vec![(
                RelationLockKey {
                    tgid: 1,
                    relid: 1259,
                    query_id: 7,
                    lockmode: 1,
                    _pad: 0,
                },
                10,
            )],
            extrapolations,
            foreign_hits: BTreeMap::from([(Function::LockRelationOid, 0)]),
        };
        let lock = ProbedCall {
            function: Function::LockRelationOid,
            detail: 0,
        };
        let estimate = results.by_function()[&lock];
        assert_eq!(
            (estimate.calls, estimate.total_ns, estimate.max_ns),
            (400, 400_000, 5_000)
        );
        assert_eq!(results.locks_by_relation(), vec![((7, 1259, 1), 40)]);
        assert_eq!(
            results.by_query()[0].1.calls,
            400,
            "per-query rows are scaled too"
        );
        assert!(render(&results, 1.0, 10).contains("25% (est.)"));
    }
}
