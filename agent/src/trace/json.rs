//! `--json FILE`: the trace summary for scripts, in a versioned schema. Fields are only ever
//! added within a version; a rename or a change of meaning bumps `schema`. Documented in
//! `docs/trace.md` ("JSON summary").

use std::collections::BTreeMap;

use exporters::{FrameKind, FunctionShare, HotPath, Profile};
use serde::Serialize;

use super::probes::{lock_mode_name, ProbeFigures, ProbeResults};
use crate::aggregate::UnwindStats;
use crate::bpf::abi::Counter;
use crate::bpf::abi::Function;
use crate::bpf::{Counters, WaitSamplerTally};
use crate::collect::off_cpu::OffCpuMode;
use crate::collect::probes::Extrapolation;
use crate::findings::Finding;
use crate::model::labels;
use crate::model::{StatementCpu, StatementPlanNodes, StatementWall, WaitTables};
use crate::postgres::blockers::BlockerEvidence;
use crate::postgres::phase::Phase;
use crate::target::Target;

pub const SCHEMA: &str = "pgscope.trace.summary/v1";

#[derive(Serialize)]
pub struct Summary {
    pub schema: &'static str,
    pub target: TargetJson,
    /// Major version attribution was decoded for; null when attribution was unavailable.
    pub postgres_major: Option<u32>,
    pub frequency_hz: u64,
    pub duration_seconds: f64,
    pub samples: SamplesJson,
    /// The functions with the most self samples (the sample's leaf), at most `--top`.
    pub top_functions: Vec<FunctionJson>,
    /// The functions with the most total samples (anywhere on the stack), at most `--top`.
    pub top_functions_by_total: Vec<FunctionJson>,
    /// Every module's samples: the executable, each library, and the kernel (`[kernel]`).
    pub modules: Vec<ModuleJson>,
    pub queries: Vec<QueryJson>,
    /// Per queryid, its on-CPU samples by the innermost plan node on the stack (the executor's
    /// per-node function nearest the leaf: `ExecHashJoin` → `HashJoin`); statements that never
    /// ran a plan node are left out.
    pub plan_nodes: Vec<PlanNodesJson>,
    pub processes: Vec<ProcessJson>,
    /// What one probed call (entry and return traps) costs here, as calibrated at the start:
    /// the cost taken out of a probed function's time per nested probed call.
    pub probe_ns_per_hit: f64,
    /// Per probed function, over all backends and queries.
    pub probes: Vec<ProbeJson>,
    /// Per probed function: traps taken by processes outside the trace that map the same file
    /// (other instances of the executable); not measured, but counted in the probe budget.
    pub probe_hits_outside_trace: BTreeMap<String, u64>,
    /// Per (queryid, probed function), over all backends.
    pub probes_by_query: Vec<ProbeByQueryJson>,
    /// LockRelationOid calls per (queryid, relation, lock mode).
    pub relation_locks: Vec<RelationLockJson>,
    /// s_lock calls per (queryid, call site): which spinlock acquisitions had to spin.
    pub spin_sites: Vec<SpinSiteJson>,
    /// Time off CPU; null when it was not measured (`--off-cpu=none`, or the kernel refused).
    pub off_cpu: Option<OffCpuJson>,
    /// What the off-CPU sampler's runs cost; null when it did not run.
    pub wait_sampler: Option<WaitSamplerJson>,
    /// With `--off-cpu=both`: the exact tracer's tables beside the sampled ones in `off_cpu`.
    pub off_cpu_exact: Option<OffCpuJson>,
    /// With `--off-cpu=both`: where the exact tracer had each thread at the sampler's runs,
    /// weighted like the samples (mode `exact_at_runs`): the sampled tables against the exact
    /// state at their own instants, without the time the runs themselves cause.
    pub off_cpu_exact_at_runs: Option<OffCpuJson>,
    /// Per queryid, its wall-clock time (on and off CPU, the client's time left out) split
    /// into CPU and each wait, largest first; empty without off-CPU time.
    pub wall_clock: Vec<WallClockJson>,
    /// Sessions that held heavyweight locks others waited for, polled with
    /// `pg_blocking_pids()` while the samples were taken (chains charged to the session at
    /// their end); null when the instance could not be polled.
    pub blockers: Option<BlockerEvidence>,
    /// What each statement the summary names did over the trace in pg_stat_statements' own
    /// counters: by queryid (decimal string), every additive column the installed version has
    /// (`calls`, `plans`, `rows`, `shared_blks_read`, `temp_blks_written`, `wal_bytes`,
    /// `jit_functions`, `total_exec_time` in ms, …) → its growth. Empty where they could not be
    /// read at both ends.
    pub pg_stat_statements: BTreeMap<String, BTreeMap<String, f64>>,
    /// By database, what pg_stat_database's counters grew by over the trace (databases whose
    /// counters did not move left out); empty where they could not be read at both ends.
    pub pg_stat_database: BTreeMap<String, BTreeMap<String, f64>>,
    /// By `backend type/object/context`, the same of pg_stat_io (PostgreSQL 16+).
    pub pg_stat_io: BTreeMap<String, BTreeMap<String, f64>>,
    /// The findings the trace printed, most severe first.
    pub findings: Vec<FindingJson>,
}

/// One finding, as printed: its rule, severity, sentence, supporting numbers, statements,
/// functions and action.
#[derive(Serialize)]
pub struct FindingJson {
    /// The rule's stable name (the agent's `kind` label).
    pub kind: &'static str,
    /// info, warning or critical.
    pub severity: &'static str,
    pub title: String,
    /// The supporting figures, as (what, value), in the order printed.
    pub numbers: Vec<NumberJson>,
    pub queryids: Vec<String>,
    /// The normalized text of each of `queryids` pg_stat_statements had, by queryid.
    pub query_texts: BTreeMap<String, String>,
    pub functions: Vec<String>,
    pub action: String,
    /// Each statement the finding covers with its own figure (a grouped finding covers
    /// several), in the order of `queryids`.
    pub statements: Vec<FindingStatementJson>,
    /// What the cause cost over the window, in nanoseconds of backend time; absent for a
    /// finding about the instance as a whole.
    pub cost_ns: Option<u64>,
}

#[derive(Serialize)]
pub struct FindingStatementJson {
    pub queryid: String,
    /// What the finding measured of this statement ("62.0% of its CPU").
    pub figure: String,
}

#[derive(Serialize)]
pub struct NumberJson {
    pub what: String,
    pub value: String,
}

impl FindingJson {
    fn new(finding: &Finding, texts: &std::collections::HashMap<i64, String>) -> Self {
        Self {
            kind: finding.kind,
            severity: finding.severity.name(),
            title: finding.title.clone(),
            numbers: finding
                .numbers
                .iter()
                .map(|(what, value)| NumberJson {
                    what: what.clone(),
                    value: value.clone(),
                })
                .collect(),
            queryids: finding.query_ids.iter().map(ToString::to_string).collect(),
            query_texts: finding
                .query_ids
                .iter()
                .filter_map(|q| Some((q.to_string(), texts.get(&q.0)?.clone())))
                .collect(),
            functions: finding.frames.clone(),
            action: finding.action.clone(),
            statements: finding
                .query_ids
                .iter()
                .enumerate()
                .map(|(i, q)| FindingStatementJson {
                    queryid: q.to_string(),
                    figure: finding
                        .cause
                        .as_ref()
                        .and_then(|c| c.figures.get(i).cloned())
                        .unwrap_or_default(),
                })
                .collect(),
            cost_ns: finding.cause.as_ref().map(|c| c.cost_ns),
        }
    }
}

#[derive(Serialize)]
pub struct WallClockJson {
    pub queryid: String,
    pub total_ns: u64,
    /// `CPU`, a wait event (`LWLock:pg_stat_statements`), or off CPU without one its class
    /// (`preempted`, `io`, …); largest first.
    pub parts: Vec<WallPartJson>,
}

#[derive(Serialize)]
pub struct WallPartJson {
    pub name: String,
    pub ns: u64,
    pub pct: f64,
}

#[derive(Serialize)]
pub struct OffCpuJson {
    /// `sampled` (each tick samples the threads off CPU, weighing one tick) or `exact` (every
    /// wait timed by the context-switch tracer).
    pub mode: &'static str,
    /// `exact`: waits at least this long were recorded with their stacks; shorter ones
    /// without. Null for `sampled`.
    pub min_stack_ns: Option<u64>,
    /// Every nanosecond the traced processes spent off CPU, idle waits included.
    pub total_ns: u64,
    /// Per (backend type, wait event in force when it blocked, class), longest first.
    pub by_wait: Vec<OffCpuWaitJson>,
    /// Per queryid: its waits, longest first, with where in Postgres it waited.
    pub by_query: Vec<OffCpuQueryJson>,
}

#[derive(Serialize)]
pub struct OffCpuWaitJson {
    pub backend_type: String,
    /// `Type:Name` as pg_stat_activity shows it, or `(no wait event)`.
    pub wait_event: String,
    /// futex, latch, io, preempted, other, idle.
    pub off_cpu: String,
    pub ns: u64,
}

#[derive(Serialize)]
pub struct OffCpuQueryJson {
    pub queryid: String,
    pub waits: Vec<OffCpuQueryWaitJson>,
}

#[derive(Serialize)]
pub struct OffCpuQueryWaitJson {
    pub wait_event: String,
    pub off_cpu: String,
    pub ns: u64,
    /// Where its longest stack waited (the wait machinery skipped), innermost first, joined by
    /// ` ← `.
    pub stack: String,
}

#[derive(Serialize)]
pub struct CallStatsJson {
    pub calls: u64,
    /// Calls measured while the probe was attached: what `calls` and `total_ns` rest on (equal
    /// to `calls` when nothing was extrapolated).
    pub measured_calls: u64,
    /// The function's own time: from entry to return, less the traps of the probed calls it
    /// made (`nested_trap_ns`).
    pub total_ns: u64,
    /// From entry to return as measured, nested probe traps included.
    pub total_ns_with_nested_traps: u64,
    /// Probe traps (entries and returns of other probed calls) taken inside these calls.
    pub nested_traps: u64,
    /// What `nested_traps` cost at the calibrated `probe_ns_per_hit`, taken out of `total_ns`.
    pub nested_trap_ns: u64,
    pub max_ns: u64,
    /// `histogram_log2_ns[i]` counts calls that took [2^i, 2^(i+1)) ns, nested probe traps
    /// included.
    pub histogram_log2_ns: Vec<u64>,
    /// Whether calls, total_ns and the histogram are estimates scaled up from the time the
    /// probe was attached (duty cycle under --probe-budget); max_ns is always as measured.
    pub extrapolated: bool,
    /// Share of the trace the probe was attached, 0..1.
    pub attached_share: f64,
}

impl CallStatsJson {
    fn new(figures: &ProbeFigures, extrapolation: Extrapolation) -> Self {
        let stats = &figures.stats;
        Self {
            calls: stats.calls,
            measured_calls: figures.measured_calls,
            total_ns: figures.total_ns,
            total_ns_with_nested_traps: stats.total_ns,
            nested_traps: stats.nested_traps,
            nested_trap_ns: figures.nested_trap_ns(),
            max_ns: stats.max_ns,
            histogram_log2_ns: stats.hist.to_vec(),
            extrapolated: extrapolation.extrapolated,
            attached_share: extrapolation.attached_share,
        }
    }
}

#[derive(Serialize)]
pub struct ProbeJson {
    /// The function name; pgss_store is split by kind: `pgss_store(exec)`, `pgss_store(plan)`,
    /// `pgss_store(text)`.
    pub function: String,
    pub calls_per_second: f64,
    #[serde(flatten)]
    pub stats: CallStatsJson,
}

#[derive(Serialize)]
pub struct ProbeByQueryJson {
    pub queryid: String,
    pub function: String,
    #[serde(flatten)]
    pub stats: CallStatsJson,
}

#[derive(Serialize)]
pub struct RelationLockJson {
    pub queryid: String,
    pub relid: u32,
    pub lockmode: &'static str,
    pub calls: u64,
    /// Calls measured while LockRelationOid was attached: what `calls` rests on.
    pub measured_calls: u64,
    /// Whether `calls` is an estimate (LockRelationOid was duty-cycled).
    pub extrapolated: bool,
}

#[derive(Serialize)]
pub struct SpinSiteJson {
    pub queryid: String,
    /// The call site's `__FILE__`, `__LINE__` and `__func__` as passed to s_lock.
    pub file: String,
    pub line: u32,
    pub function: String,
    pub calls: u64,
    /// Calls measured while s_lock was attached: what `calls` rests on.
    pub measured_calls: u64,
    /// Time in s_lock (spinning, then sleeping between spins) until the lock was taken.
    pub total_ns: u64,
    pub max_ns: u64,
    /// Whether calls and total_ns are estimates (s_lock was duty-cycled).
    pub extrapolated: bool,
}

#[derive(Serialize)]
pub struct TargetJson {
    /// "backend" or "instance".
    pub kind: &'static str,
    /// The backend's PID, or the instance's postmaster PID.
    pub pid: u32,
}

#[derive(Serialize)]
pub struct SamplesJson {
    /// Samples kept in the profile (after --queryid filtering).
    pub profiled: u64,
    /// Samples the kernel side saw for the target processes.
    pub taken_in_kernel: u64,
    /// Samples lost, by reason (counter name → count); only reasons that occurred.
    pub lost: BTreeMap<&'static str, u64>,
    /// Off-CPU samples that sought a stack: sent with one, or left without (what `degraded`'s
    /// off-CPU reasons are a part of, with `taken_in_kernel`).
    pub off_cpu_sought_stack: u64,
    /// Samples kept with a degraded part (e.g. partial user stack), by reason.
    pub degraded: BTreeMap<&'static str, u64>,
    /// Off-CPU samples whose whole stack was copied after the thread ran and went back into the
    /// same wait of the same statement, by reason.
    pub late_stacks: BTreeMap<&'static str, u64>,
    /// Share of samples whose user stack unwound to the process root, in percent.
    pub user_stacks_complete_pct: f64,
    /// Samples of other queries left out by --queryid.
    pub filtered_out: u64,
}

#[derive(Serialize)]
pub struct FunctionJson {
    pub name: String,
    /// "user" or "kernel".
    pub kind: &'static str,
    pub self_samples: u64,
    pub total_samples: u64,
    pub self_pct: f64,
    pub total_pct: f64,
}

#[derive(Serialize)]
pub struct ModuleJson {
    pub name: String,
    /// Samples whose leaf frame is in the module.
    pub self_samples: u64,
    /// Samples with a frame of the module anywhere on the stack.
    pub total_samples: u64,
    pub self_pct: f64,
    pub total_pct: f64,
}

/// A call path holding at least 5% of a statement's samples, down to where they spread out.
#[derive(Serialize)]
pub struct HotPathJson {
    /// Samples under the path's last frame that no longer path of the statement holds.
    pub samples: u64,
    /// `samples` in % of the statement's.
    pub share_pct: f64,
    /// Samples whose leaf is the path's last frame.
    pub self_samples: u64,
    /// Root first, each with its samples at this place of the path.
    pub frames: Vec<PathFrameJson>,
}

#[derive(Serialize)]
pub struct PathFrameJson {
    pub name: String,
    /// "user" or "kernel".
    pub kind: &'static str,
    /// The file of a user frame, when known.
    pub module: Option<String>,
    pub samples: u64,
}

#[derive(Serialize)]
pub struct QueryJson {
    /// pg_stat_statements.queryid as a decimal string: 64-bit values do not survive JSON
    /// numbers in most parsers.
    pub queryid: String,
    pub samples: u64,
    pub share_pct: f64,
    /// The normalized text from pg_stat_statements (`$1` for constants; never parameters), when
    /// pgscope could connect.
    pub query: Option<String>,
    /// Samples per statement phase; `other` is outside every phase function.
    pub phases: BTreeMap<&'static str, u64>,
    pub hottest_function: Option<String>,
    /// Its hot paths, most samples first (at most 8).
    pub hot_paths: Vec<HotPathJson>,
    /// Samples under each of Postgres' subsystems (`sort`, `jit`, `wal`, …: the families of
    /// functions in docs/findings.md), a sample counted once in each family on its stack.
    pub subsystems: BTreeMap<&'static str, u64>,
    /// Samples in each trigger of the statement, by its `trigger` label (`constraint <name>`,
    /// `trigger <name>`).
    pub triggers: BTreeMap<String, u64>,
}

#[derive(Serialize)]
pub struct PlanNodesJson {
    pub queryid: String,
    /// All of the statement's on-CPU samples.
    pub samples: u64,
    /// Most samples first.
    pub nodes: Vec<PlanNodeJson>,
    /// Samples with no plan node on the stack (parsing, planning, commit, client I/O).
    pub outside_nodes_samples: u64,
}

#[derive(Serialize)]
pub struct PlanNodeJson {
    /// The plan node type as EXPLAIN spells it without spaces (`HashJoin`, `SeqScan`, `Agg`).
    pub node: String,
    pub samples: u64,
    /// Share of the statement's samples.
    pub share_pct: f64,
}

/// The off-CPU sampler's runs: each takes its CPU, at real-time priority, from the process
/// there.
#[derive(Serialize)]
pub struct WaitSamplerJson {
    pub runs: u64,
    pub mean_run_us: f64,
    /// The runs' time over the trace's, in percent of one CPU.
    pub cpu_pct: f64,
}

#[derive(Serialize)]
pub struct ProcessJson {
    pub pid: u32,
    pub backend_type: Option<String>,
    pub samples: u64,
}

pub struct SummaryInputs<'a> {
    pub target: &'a Target,
    pub postgres_major: Option<u32>,
    pub frequency_hz: u64,
    pub duration_seconds: f64,
    pub counters: &'a Counters,
    pub stats: &'a UnwindStats,
    pub filtered_out: u64,
    pub profile: &'a Profile,
    pub functions: &'a [FunctionShare],
    pub functions_by_total: &'a [FunctionShare],
    pub queries: &'a [StatementCpu],
    pub plan_nodes: &'a [StatementPlanNodes],
    pub probes: &'a ProbeResults,
    pub query_texts: &'a std::collections::HashMap<i64, String>,
    /// The off-CPU tables (idle waits included), how they were measured, and the exact
    /// tracer's stack threshold in ns.
    pub off_cpu: Option<(&'a WaitTables, OffCpuMode, u64)>,
    /// The exact tracer's tables when the sampler ran too.
    pub off_cpu_exact: Option<&'a WaitTables>,
    /// The exact tracer's state at the sampler's runs, when both ran.
    pub off_cpu_exact_at_runs: Option<&'a WaitTables>,
    /// What the off-CPU sampler's thread did (no runs when it did not run).
    pub wait_sampler: &'a WaitSamplerTally,
    pub walls: &'a [StatementWall],
    pub blockers: Option<&'a BlockerEvidence>,
    /// pg_stat_statements' counters' growth by queryid, when read.
    pub pgss_deltas: Option<&'a BTreeMap<String, BTreeMap<String, f64>>>,
    /// pg_stat_database's and pg_stat_io's growth over the trace, when read.
    pub stat_views: Option<(&'a CounterRows, &'a CounterRows)>,
    pub findings: &'a [Finding],
}

fn kind_name(kind: FrameKind) -> &'static str {
    match kind {
        FrameKind::User => "user",
        FrameKind::Kernel => "kernel",
    }
}

fn function_json(f: &FunctionShare) -> FunctionJson {
    FunctionJson {
        name: f.name.to_string(),
        kind: kind_name(f.kind),
        self_samples: f.self_count,
        total_samples: f.total_count,
        self_pct: f.self_pct,
        total_pct: f.total_pct,
    }
}

fn hot_path_json(path: &HotPath, statement_samples: u64) -> HotPathJson {
    HotPathJson {
        samples: path.count,
        share_pct: 100.0 * path.count as f64 / statement_samples.max(1) as f64,
        self_samples: path.self_count,
        frames: path
            .steps
            .iter()
            .map(|step| PathFrameJson {
                name: step.frame.name.to_string(),
                kind: kind_name(step.frame.kind),
                module: step.frame.module.as_deref().map(str::to_string),
                samples: step.count,
            })
            .collect(),
    }
}

/// Counters by row (a database, a pg_stat_io row), by column.
pub type CounterRows = BTreeMap<String, BTreeMap<String, f64>>;

pub fn build(inputs: &SummaryInputs<'_>) -> Summary {
    let total = inputs.profile.total_count();
    let pct = |n: u64| {
        if total == 0 {
            0.0
        } else {
            100.0 * n as f64 / total as f64
        }
    };
    let (kind, pid) = match inputs.target {
        Target::Backend(p) => ("backend", p.pid),
        Target::Instance { postmaster } => ("instance", postmaster.pid),
    };
    let by_reason = |list: Vec<(Counter, u64)>| list.into_iter().map(|(c, n)| (c.name(), n)).collect();
    Summary {
        schema: SCHEMA,
        target: TargetJson { kind, pid },
        postgres_major: inputs.postgres_major,
        frequency_hz: inputs.frequency_hz,
        duration_seconds: inputs.duration_seconds,
        samples: SamplesJson {
            profiled: total,
            taken_in_kernel: inputs.counters.get(Counter::Samples),
            off_cpu_sought_stack: inputs.counters.off_cpu_stack_seekers(),
            lost: by_reason(inputs.counters.losses()),
            degraded: by_reason(inputs.counters.degradations()),
            late_stacks: by_reason(inputs.counters.late_stacks()),
            user_stacks_complete_pct: inputs.stats.complete_pct(),
            filtered_out: inputs.filtered_out,
        },
        top_functions: inputs.functions.iter().map(function_json).collect(),
        top_functions_by_total: inputs.functions_by_total.iter().map(function_json).collect(),
        modules: exporters::module_totals(inputs.profile)
            .into_iter()
            .map(|m| ModuleJson {
                name: m.name.to_string(),
                self_samples: m.self_count,
                total_samples: m.total_count,
                self_pct: m.self_pct,
                total_pct: m.total_pct,
            })
            .collect(),
        queries: inputs
            .queries
            .iter()
            .map(|q| {
                let mut phases: BTreeMap<&'static str, u64> = Phase::ALL
                    .iter()
                    .zip(q.by_phase)
                    .map(|(p, n)| (p.label(), n))
                    .collect();
                phases.insert("other", q.other());
                QueryJson {
                    queryid: q.query_id.to_string(),
                    samples: q.samples,
                    share_pct: pct(q.samples),
                    query: inputs.query_texts.get(&q.query_id.0).cloned(),
                    phases,
                    hottest_function: q.hottest_function.clone(),
                    hot_paths: q.hot_paths.iter().map(|p| hot_path_json(p, q.samples)).collect(),
                    subsystems: q.subsystems.clone(),
                    triggers: q.triggers.clone(),
                }
            })
            .collect(),
        plan_nodes: inputs
            .plan_nodes
            .iter()
            .map(|statement| PlanNodesJson {
                queryid: statement.query_id.to_string(),
                samples: statement.samples,
                nodes: statement
                    .by_node
                    .iter()
                    .map(|(node, samples)| PlanNodeJson {
                        node: node.clone(),
                        samples: *samples,
                        share_pct: statement.pct(*samples),
                    })
                    .collect(),
                outside_nodes_samples: statement.outside_nodes(),
            })
            .collect(),
        processes: processes(inputs.profile),
        probe_ns_per_hit: inputs.probes.ns_per_hit,
        probe_hits_outside_trace: inputs
            .probes
            .foreign_hits
            .iter()
            .map(|(function, &hits)| (function.name().to_string(), hits))
            .collect(),
        probes: inputs
            .probes
            .by_function()
            .iter()
            .map(|(call, figures)| ProbeJson {
                function: call.label(),
                calls_per_second: figures.stats.calls as f64 / inputs.duration_seconds.max(1e-9),
                stats: CallStatsJson::new(figures, inputs.probes.extrapolation(call.function)),
            })
            .collect(),
        probes_by_query: inputs
            .probes
            .by_query()
            .iter()
            .map(|((query_id, call), figures)| ProbeByQueryJson {
                queryid: query_id.to_string(),
                function: call.label(),
                stats: CallStatsJson::new(figures, inputs.probes.extrapolation(call.function)),
            })
            .collect(),
        relation_locks: inputs
            .probes
            .locks_by_relation()
            .into_iter()
            .map(
                |((query_id, relid, mode), (calls, measured_calls))| RelationLockJson {
                    queryid: query_id.to_string(),
                    relid,
                    lockmode: lock_mode_name(mode),
                    calls,
                    measured_calls,
                    extrapolated: inputs
                        .probes
                        .extrapolation(Function::LockRelationOid)
                        .extrapolated,
                },
            )
            .collect(),
        spin_sites: inputs
            .probes
            .spin_sites
            .iter()
            .map(|site| SpinSiteJson {
                queryid: site.query_id.to_string(),
                file: site.file.clone(),
                line: site.line,
                function: site.function.clone(),
                calls: site.stats.calls,
                measured_calls: site.measured_calls,
                total_ns: site.stats.total_ns,
                max_ns: site.stats.max_ns,
                extrapolated: inputs.probes.extrapolation(Function::SLock).extrapolated,
            })
            .collect(),
        off_cpu: inputs.off_cpu.map(|(waits, mode, min_stack_ns)| {
            let min_stack_ns = (mode == OffCpuMode::Exact).then_some(min_stack_ns);
            off_cpu_json(
                waits,
                if mode == OffCpuMode::Exact {
                    "exact"
                } else {
                    "sampled"
                },
                min_stack_ns,
            )
        }),
        wait_sampler: (inputs.wait_sampler.runs > 0).then(|| WaitSamplerJson {
            runs: inputs.wait_sampler.runs,
            mean_run_us: inputs.wait_sampler.mean_run_us(),
            cpu_pct: inputs
                .wait_sampler
                .cpu_pct((inputs.duration_seconds * 1e9) as u64),
        }),
        off_cpu_exact: inputs.off_cpu_exact.map(|waits| {
            let min_stack_ns = inputs.off_cpu.map(|(_, _, ns)| ns);
            off_cpu_json(waits, "exact", min_stack_ns)
        }),
        off_cpu_exact_at_runs: inputs
            .off_cpu_exact_at_runs
            .map(|waits| off_cpu_json(waits, "exact_at_runs", None)),
        wall_clock: inputs
            .walls
            .iter()
            .map(|wall| WallClockJson {
                queryid: wall.query_id.to_string(),
                total_ns: wall.total_ns,
                parts: wall
                    .parts
                    .iter()
                    .map(|part| WallPartJson {
                        name: part.name.clone(),
                        ns: part.ns,
                        pct: wall.pct(part.ns),
                    })
                    .collect(),
            })
            .collect(),
        blockers: inputs.blockers.cloned(),
        pg_stat_statements: inputs.pgss_deltas.cloned().unwrap_or_default(),
        pg_stat_database: inputs
            .stat_views
            .map(|(database, _)| database.clone())
            .unwrap_or_default(),
        pg_stat_io: inputs.stat_views.map(|(_, io)| io.clone()).unwrap_or_default(),
        findings: inputs
            .findings
            .iter()
            .map(|f| FindingJson::new(f, inputs.query_texts))
            .collect(),
    }
}

fn off_cpu_json(waits: &WaitTables, mode: &'static str, min_stack_ns: Option<u64>) -> OffCpuJson {
    OffCpuJson {
        mode,
        min_stack_ns,
        total_ns: waits.total_ns(),
        by_wait: waits
            .by_wait
            .iter()
            .map(|row| OffCpuWaitJson {
                backend_type: row.backend_type.clone(),
                wait_event: row.wait.clone(),
                off_cpu: row.class.clone(),
                ns: row.ns,
            })
            .collect(),
        by_query: waits
            .by_query
            .iter()
            .filter(|query| query.query_id.is_statement())
            .map(|query| OffCpuQueryJson {
                queryid: query.query_id.to_string(),
                waits: query
                    .waits
                    .iter()
                    .map(|row| OffCpuQueryWaitJson {
                        wait_event: row.wait.clone(),
                        off_cpu: row.class.clone(),
                        ns: row.ns,
                        stack: row.stack.clone(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn processes(profile: &Profile) -> Vec<ProcessJson> {
    let mut by_pid: BTreeMap<u32, (Option<String>, u64)> = BTreeMap::new();
    for sample in &profile.samples {
        let label = |key: &str| {
            sample
                .labels
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        };
        let Some(pid) = label(labels::PID).and_then(|p| p.parse().ok()) else {
            continue;
        };
        let entry = by_pid.entry(pid).or_insert((None, 0));
        entry.1 += sample.count;
        if entry.0.is_none() {
            entry.0 = label(labels::BACKEND_TYPE);
        }
    }
    let mut processes: Vec<ProcessJson> = by_pid
        .into_iter()
        .map(|(pid, (backend_type, samples))| ProcessJson {
            pid,
            backend_type,
            samples,
        })
        .collect();
    processes.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.pid.cmp(&b.pid)));
    processes
}
