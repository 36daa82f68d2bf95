//! `--probes`: per-call statistics of chosen Postgres functions, attached at the start of a
//! trace and read back at its end, per function and per (queryid, function).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{bail, Context, Result};

use crate::bpf::abi::{CallKey, CallStats, Function, ProbedCall, RelationLockKey};

/// `ProbedCall::detail` of pgss_store's exec call (PGSS_EXEC + 2).
const PGSS_EXEC: u32 = 3;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::warn;

use super::duty::{plan_shared_duty, DutyCycle};
use crate::bpf::{FunctionLinks, OnCpuProbes};
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

/// One probed function, attached or between duty-cycle windows.
struct ActiveProbe {
    function: Function,
    path: PathBuf,
    file_offset: u64,
    links: Option<FunctionLinks>,
    /// Whether it follows the shared duty cycle (it is hot) or stays attached.
    cycled: bool,
    /// Time attached so far, from attach completed to detach started: the denominator of its
    /// extrapolation.
    attached_total: Duration,
    /// When the current attachment completed.
    attached_since: Option<Instant>,
    /// Hits and attached time since the last re-plan: the hit rate while attached.
    hits_window: u64,
    attached_window: Duration,
}

/// The probed functions of a trace and their duty cycle.
pub struct ProbeSet {
    probes: Vec<ActiveProbe>,
    /// Budget as a fraction of the instance's CPU time; None: every call is measured.
    budget: Option<f64>,
    ns_per_hit: f64,
    cycle: DutyCycle,
    last_hits: [u64; Function::ALL.len()],
    since_plan: Duration,
    /// Hit counters and time of the last live-view line.
    live_hits: [u64; Function::ALL.len()],
    live_since: Option<Instant>,
}

/// How often the duty cycle is re-planned from the measured hit rates.
const REPLAN_EVERY: Duration = Duration::from_secs(1);

impl ProbeSet {
    /// Attaches what can be attached and says, per function, what could not and why; the
    /// trace goes on with the others. Functions are found with the symbolizer's symbol tables,
    /// so static functions of stripped files count when their debug file is installed.
    pub fn attach(
        probes: &mut OnCpuProbes,
        symbolizer: &mut Symbolizer,
        functions: &[Function],
        pid: u32,
        budget: Option<f64>,
        ns_per_hit: f64,
    ) -> Result<ProbeSet> {
        let mut set = ProbeSet {
            probes: Vec::new(),
            budget,
            ns_per_hit,
            cycle: DutyCycle::new(),
            last_hits: [0; Function::ALL.len()],
            since_plan: Duration::ZERO,
            live_hits: [0; Function::ALL.len()],
            live_since: None,
        };
        if functions.is_empty() {
            return Ok(set);
        }
        set.last_hits = probes.function_hits()?;
        set.live_hits = set.last_hits;
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
            .with_context(|| format!("cannot resolve the executable of PID {pid}"))?;
        let executable = exe
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        for &function in functions {
            let location =
                match symbolizer.find_function(pid, &module_of(function, &executable), function.name()) {
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
                Ok(links) => set.probes.push(ActiveProbe {
                    function,
                    path: location.path,
                    file_offset: location.file_offset,
                    links: Some(links),
                    cycled: false,
                    attached_total: Duration::ZERO,
                    attached_since: Some(Instant::now()),
                    hits_window: 0,
                    attached_window: Duration::ZERO,
                }),
                Err(error) => eprintln!("pgscope: probe {} not attached: {error:#}", function.name()),
            }
        }
        Ok(set)
    }

    /// Ends every probe's attached time now: call when the maps are read, before detaching,
    /// so that all functions' counts cover the same period.
    pub fn stop_clock(&mut self) {
        let now = Instant::now();
        for probe in &mut self.probes {
            if let Some(since) = probe.attached_since.take() {
                probe.attached_total += now - since;
            }
        }
    }

    /// Detaches every probe (the end of the trace; their maps stay readable).
    pub fn detach_all(&mut self, probes: &mut OnCpuProbes) -> Result<()> {
        self.stop_clock();
        for probe in &mut self.probes {
            if let Some(links) = probe.links.take() {
                probes.detach_function(links)?;
            }
        }
        Ok(())
    }

    /// Live view lines: calls per second of each probed function over the last second.
    pub fn live_lines(&mut self) -> Vec<String> {
        let now = Instant::now();
        let seconds = self.live_since.map_or(0.0, |since| (now - since).as_secs_f64());
        self.live_since = Some(now);
        let mut lines = Vec::new();
        for probe in &self.probes {
            let index = probe.function as usize;
            let calls = self.last_hits[index].saturating_sub(self.live_hits[index]);
            if seconds > 0.0 {
                let state = if probe.links.is_some() {
                    ""
                } else {
                    " (detached: duty cycle)"
                };
                lines.push(format!(
                    "  probe {:<24} {:>9.0} calls/s{state}",
                    probe.function.name(),
                    calls as f64 / seconds
                ));
            }
        }
        self.live_hits = self.last_hits;
        lines
    }

    pub fn functions(&self) -> Vec<Function> {
        self.probes.iter().map(|p| p.function).collect()
    }

    /// Advances by `elapsed`: accounts hits and attached time, re-plans once a second from the
    /// instance's CPU use (`instance_cpu_ns_per_s`, from the on-CPU samples), and attaches or
    /// detaches the hot probes when the shared window starts or ends.
    pub fn tick(
        &mut self,
        probes: &mut OnCpuProbes,
        elapsed: Duration,
        instance_cpu_ns_per_s: f64,
    ) -> Result<()> {
        if self.probes.is_empty() {
            return Ok(());
        }
        let hits = probes.function_hits()?;
        for probe in &mut self.probes {
            if probe.links.is_some() {
                let index = probe.function as usize;
                probe.hits_window += hits[index].saturating_sub(self.last_hits[index]);
                probe.attached_window += elapsed;
            }
        }
        self.last_hits = hits;

        self.since_plan += elapsed;
        if let Some(fraction) = self.budget.filter(|_| self.since_plan >= REPLAN_EVERY) {
            self.since_plan = Duration::ZERO;
            self.replan(fraction * instance_cpu_ns_per_s);
        }

        let switch = self.cycle.advance(elapsed);
        for probe in &mut self.probes {
            // Hot probes follow the shared window; the others stay attached.
            let want = !probe.cycled || self.cycle.is_attached();
            let result = match (want, probe.links.take()) {
                (false, Some(links)) => {
                    if let Some(since) = probe.attached_since.take() {
                        probe.attached_total += since.elapsed();
                    }
                    probes.detach_function(links)
                }
                (true, None) => probes
                    .attach_function(probe.function, &probe.path, probe.file_offset)
                    .map(|links| {
                        probe.links = Some(links);
                        probe.attached_since = Some(Instant::now());
                    }),
                (_, links) => {
                    probe.links = links;
                    Ok(())
                }
            };
            if let Err(error) = result {
                warn!(
                    "cannot switch probe {} ({switch:?}): {error:#}",
                    probe.function.name()
                );
            }
        }
        Ok(())
    }

    /// Recomputes which probes are hot and the shared duty, from hit rates while attached.
    fn replan(&mut self, budget_ns_per_s: f64) {
        // A probe not attached since the last plan keeps its last known rate (as cost 0 here
        // would make it cheap): only re-plan with every rate measured.
        if self.probes.iter().any(|p| p.attached_window.is_zero()) {
            return;
        }
        let costs: Vec<f64> = self
            .probes
            .iter()
            .map(|p| p.hits_window as f64 / p.attached_window.as_secs_f64() * self.ns_per_hit)
            .collect();
        let (duty, hot) = plan_shared_duty(&costs, budget_ns_per_s);
        self.cycle.set_duty(duty);
        for (probe, hot) in self.probes.iter_mut().zip(hot) {
            probe.cycled = hot && duty < 1.0;
            probe.hits_window = 0;
            probe.attached_window = Duration::ZERO;
        }
    }

    /// Per function: the factor from measured to estimated counts, whether that is an
    /// extrapolation, and the share of the trace the probe was attached.
    pub fn extrapolations(&self, trace: Duration) -> BTreeMap<Function, Extrapolation> {
        self.probes
            .iter()
            .map(|p| {
                let attached = p.attached_total.as_secs_f64();
                let total = trace.as_secs_f64().max(1e-9);
                let factor = if attached > 0.0 {
                    (total / attached).max(1.0)
                } else {
                    1.0
                };
                let extrapolated = factor > 1.01;
                (
                    p.function,
                    Extrapolation {
                        factor,
                        extrapolated,
                        attached_share: (attached / total).min(1.0),
                    },
                )
            })
            .collect()
    }
}

/// How a function's measured counts relate to the whole trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Extrapolation {
    pub factor: f64,
    pub extrapolated: bool,
    /// Share of the trace the probe was attached (its effective duty cycle).
    pub attached_share: f64,
}

impl Default for Extrapolation {
    fn default() -> Self {
        Self {
            factor: 1.0,
            extrapolated: false,
            attached_share: 1.0,
        }
    }
}

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
    pub extrapolations: BTreeMap<Function, Extrapolation>,
}

impl ProbeResults {
    pub fn collect(probes: &OnCpuProbes, set: &ProbeSet, trace: Duration) -> Result<Self> {
        let attached = set.functions();
        if attached.is_empty() {
            return Ok(Self::default());
        }
        Ok(Self {
            attached,
            calls: probes.call_stats()?,
            relation_locks: probes.relation_locks()?,
            extrapolations: set.extrapolations(trace),
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
            extrapolations: BTreeMap::new(),
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
