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
use crate::collect::probes::nested::corrected_total_ns;
use crate::collect::probes::{Extrapolation, ProbeSet};

/// `ProbedCall::detail` of pgss_store's exec call (PGSS_EXEC + 2).
const PGSS_EXEC: u32 = 3;

fn scaled(stats: &CallStats, factor: f64) -> CallStats {
    let scale = |n: u64| (n as f64 * factor).round() as u64;
    let mut out = *stats;
    out.calls = scale(stats.calls);
    out.total_ns = scale(stats.total_ns);
    out.nested_traps = scale(stats.nested_traps);
    for bucket in out.hist.iter_mut() {
        *bucket = scale(*bucket);
    }
    out
}

/// (queryid, relid, lock mode) of LockRelationOid's calls.
pub type RelationLockRow = (i64, u32, u32);

/// One row of the probe tables: the figures over the whole trace and what they rest on.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProbeFigures {
    /// Scaled to the whole trace where duty-cycled; `total_ns` as measured, from entry to
    /// return, the traps of nested probed calls included (the histogram too).
    pub stats: CallStats,
    /// `stats.total_ns` without the traps of nested probed calls: the function's own time.
    pub total_ns: u64,
    /// Calls measured while the probe was attached: the support of `stats.calls` (equal to
    /// it when the probe was never detached).
    pub measured_calls: u64,
}

impl ProbeFigures {
    fn add(&mut self, measured: &CallStats, extrapolation: Extrapolation, ns_per_hit: f64) {
        let estimate = scaled(measured, extrapolation.factor);
        self.stats.merge(&estimate);
        self.total_ns += corrected_total_ns(&estimate, ns_per_hit);
        self.measured_calls += measured.calls;
    }

    /// Nanoseconds taken out of `stats.total_ns` for nested probe traps.
    pub fn nested_trap_ns(&self) -> u64 {
        self.stats.total_ns.saturating_sub(self.total_ns)
    }

    /// Mean ns per call of the function's own time; 0 without calls.
    pub fn avg_ns(&self) -> f64 {
        if self.stats.calls == 0 {
            0.0
        } else {
            self.total_ns as f64 / self.stats.calls as f64
        }
    }
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
    /// The calibrated cost of one probed call (entry and return): what each nested probed call
    /// added to the time of the probed call around it.
    pub ns_per_hit: f64,
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
            ns_per_hit: set.ns_per_hit(),
        })
    }

    pub fn extrapolation(&self, function: Function) -> Extrapolation {
        self.extrapolations.get(&function).copied().unwrap_or_default()
    }

    /// Figures per function (pgss_store per kind) over all backends and queries; functions
    /// attached but never called are listed with zero calls.
    pub fn by_function(&self) -> BTreeMap<ProbedCall, ProbeFigures> {
        let mut out: BTreeMap<ProbedCall, ProbeFigures> = self
            .attached
            .iter()
            .map(|&function| {
                let detail = if function == Function::PgssStore {
                    PGSS_EXEC
                } else {
                    0
                };
                (ProbedCall { function, detail }, ProbeFigures::default())
            })
            .collect();
        for (key, stats) in &self.calls {
            if let Some(call) = ProbedCall::from_key(key) {
                let extrapolation = self.extrapolation(call.function);
                out.entry(call)
                    .or_default()
                    .add(stats, extrapolation, self.ns_per_hit);
            }
        }
        out
    }

    /// Figures per (queryid, function) over all backends, by the function's own total time
    /// (nested probe traps taken out), longest first.
    pub fn by_query(&self) -> Vec<((i64, ProbedCall), ProbeFigures)> {
        let mut merged: BTreeMap<(i64, ProbedCall), ProbeFigures> = BTreeMap::new();
        for (key, stats) in &self.calls {
            if let Some(call) = ProbedCall::from_key(key) {
                let extrapolation = self.extrapolation(call.function);
                merged.entry((key.query_id as i64, call)).or_default().add(
                    stats,
                    extrapolation,
                    self.ns_per_hit,
                );
            }
        }
        let mut rows: Vec<_> = merged.into_iter().collect();
        rows.sort_by(|a, b| b.1.total_ns.cmp(&a.1.total_ns).then(a.0.cmp(&b.0)));
        rows
    }

    /// LockRelationOid calls per (queryid, relation, mode) over all backends, most first: the
    /// estimate over the trace and the calls measured while attached.
    pub fn locks_by_relation(&self) -> Vec<(RelationLockRow, (u64, u64))> {
        let factor = self.extrapolation(Function::LockRelationOid).factor;
        let mut merged: BTreeMap<(i64, u32, u32), (u64, u64)> = BTreeMap::new();
        for (key, calls) in &self.relation_locks {
            let estimate = (*calls as f64 * factor).round() as u64;
            let slot = merged
                .entry((key.query_id as i64, key.relid, key.lockmode))
                .or_insert((0, 0));
            slot.0 += estimate;
            slot.1 += calls;
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
/// Times are the functions' own: the traps of nested probed calls are taken out ("nested ms").
/// Beside every count scaled up from a duty cycle, "measured" is what it rests on.
pub fn render(results: &ProbeResults, seconds: f64, limit: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>10} {:>10} {:>10} {:>11} {:>10} {:>9} {:>9} {:>9} {:>10}  attached",
        "function",
        "calls",
        "measured",
        "calls/s",
        "total ms",
        "nested ms",
        "avg µs",
        "p50 µs≤",
        "p99 µs≤",
        "max µs"
    );
    for (call, figures) in results.by_function() {
        let stats = figures.stats;
        let quantile = |q| {
            stats
                .quantile_upper_ns(q)
                .map(|ns| format!("{:.1}", micros(ns)))
                .unwrap_or("-".into())
        };
        let _ = writeln!(
            out,
            "{:<24} {:>10} {:>10} {:>10.0} {:>11.2} {:>10.2} {:>9.2} {:>9} {:>9} {:>10.1}  {}",
            call.label(),
            stats.calls,
            figures.measured_calls,
            stats.calls as f64 / seconds.max(1e-9),
            figures.total_ns as f64 / 1e6,
            figures.nested_trap_ns() as f64 / 1e6,
            figures.avg_ns() / 1000.0,
            quantile(0.5),
            quantile(0.99),
            micros(stats.max_ns),
            attached_note(results.extrapolation(call.function))
        );
    }
    let _ = writeln!(
        out,
        "(total ms: the function's own time, {:.0} ns per nested probed call taken out as \
         \"nested ms\"; latency quantiles include them)",
        results.ns_per_hit
    );
    let by_query = results.by_query();
    if !by_query.is_empty() {
        let _ = writeln!(out, "\nprobed functions by query (longest total first):");
        let _ = writeln!(
            out,
            "{:>21} {:<24} {:>10} {:>10} {:>11} {:>10} {:>9}",
            "queryid", "function", "calls", "measured", "total ms", "nested ms", "avg µs"
        );
        for ((query_id, call), figures) in by_query.iter().take(limit) {
            let _ = writeln!(
                out,
                "{:>21} {:<24} {:>10} {:>10} {:>11.2} {:>10.2} {:>9.2}",
                query_id,
                call.label(),
                figures.stats.calls,
                figures.measured_calls,
                figures.total_ns as f64 / 1e6,
                figures.nested_trap_ns() as f64 / 1e6,
                figures.avg_ns() / 1000.0
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
            "{:>21} {:>10} {:<26} {:>10} {:>10}",
            "queryid", "relid", "mode", "calls", "measured"
        );
        for ((query_id, relid, mode), (calls, measured)) in locks.iter().take(limit) {
            let _ = writeln!(
                out,
                "{:>21} {:>10} {:<26} {:>10} {:>10}",
                query_id,
                relid,
                lock_mode_name(*mode),
                calls,
                measured
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
            function: Function::LockRelationOid.id(),
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
            ns_per_hit: 2000.0,
        };
        let by_function = results.by_function();
        let lock = ProbedCall {
            function: Function::LockRelationOid,
            detail: 0,
        };
        assert_eq!(by_function[&lock].stats.calls, 8);
        assert_eq!(
            by_function[&ProbedCall {
                function: Function::BtGetroot,
                detail: 0
            }]
                .stats
                .calls,
            0,
            "attached but never called"
        );
        let by_query = results.by_query();
        assert_eq!(
            by_query[0],
            (
                (7, lock),
                ProbeFigures {
                    stats: stats(7),
                    total_ns: 7000,
                    measured_calls: 7
                }
            )
        );
        assert_eq!(results.locks_by_relation(), vec![((7, 16384, 1), (7, 7))]);
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
            function: Function::LockRelationOid.id(),
            query_id: 7,
        };
        let measured = CallStats {
            calls: 100,
            total_ns: 100_000,
            max_ns: 5_000,
            nested_traps: 20,
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
            ns_per_hit: 1000.0,
        };
        let lock = ProbedCall {
            function: Function::LockRelationOid,
            detail: 0,
        };
        let estimate = results.by_function()[&lock];
        assert_eq!(
            (
                estimate.stats.calls,
                estimate.stats.total_ns,
                estimate.stats.max_ns
            ),
            (400, 400_000, 5_000)
        );
        // 20 nested traps measured, 80 estimated, at half of 1000 ns each.
        assert_eq!(
            (
                estimate.stats.nested_traps,
                estimate.total_ns,
                estimate.measured_calls
            ),
            (80, 360_000, 100)
        );
        assert_eq!(results.locks_by_relation(), vec![((7, 1259, 1), (40, 10))]);
        assert_eq!(
            results.by_query()[0].1.stats.calls,
            400,
            "per-query rows are scaled too"
        );
        let table = render(&results, 1.0, 10);
        assert!(table.contains("25% (est.)"), "{table}");
        let row = table
            .lines()
            .find(|l| l.starts_with("LockRelationOid"))
            .expect("a LockRelationOid row");
        let columns: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            columns[..6],
            ["LockRelationOid", "400", "100", "400", "0.36", "0.04"],
            "estimate, the calls it rests on, own and nested time: {table}"
        );
    }
}
