//! Findings: what the measurements mean, in a DBA's words. Each rule reads the evidence a
//! trace (or an agent interval) gathered — on-CPU stacks per queryid and phase, function-probe
//! counts — and says what it found, with the numbers, the queryids and frames involved and
//! what to consider. Rules follow Postgres mechanics (what a phase or a function does), with
//! thresholds on shares of the measured time, not on particular workloads.

mod cpu;
mod facts;
mod functions;
mod indexes;
mod pgss;
mod phases;
mod probes;
mod spin_sites;
mod waits;

use std::fmt::Write as _;

use exporters::Profile;

pub use pgss::PgssEvidence;
pub use probes::ProbeRow;
pub use spin_sites::SpinSiteRow;

/// How much a finding matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Where the time goes; always reported.
    Info,
    /// A cost worth acting on.
    Warning,
    /// A cost that dominates what the instance does.
    Critical,
}

impl Severity {
    pub fn name(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }
}

/// One diagnosis.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    /// Stable name of the rule (a metric label).
    pub kind: &'static str,
    pub severity: Severity,
    /// What was found, in one sentence.
    pub title: String,
    /// The numbers that support it, as (what, value).
    pub numbers: Vec<(String, String)>,
    pub query_ids: Vec<i64>,
    pub frames: Vec<String>,
    /// What to consider doing.
    pub action: String,
}

/// What the rules read.
pub struct Evidence<'a> {
    /// On-CPU samples with `queryid` and `phase` labels.
    pub on_cpu: &'a Profile,
    /// Function-probe counts per (queryid, function), estimates where duty-cycled.
    pub probes: &'a [ProbeRow],
    /// Off-CPU time with `wait_event` and `off_cpu` labels, when measured.
    pub off_cpu: Option<&'a Profile>,
    /// pg_stat_statements' eviction counter over the measurement, when it could be read.
    pub pgss: Option<PgssEvidence>,
    /// Settings and sizes read over SQL, when pgscope could connect.
    pub instance: Option<&'a crate::postgres::sql::InstanceFacts>,
    /// Spinlock acquisitions that spun, per call site and queryid (`--probes s_lock`).
    pub spin_sites: &'a [SpinSiteRow],
}

/// Every rule over the evidence, most severe first.
pub fn evaluate(evidence: &Evidence) -> Vec<Finding> {
    let queries = cpu::QueryCpu::from_profile(evidence.on_cpu);
    let mut findings = Vec::new();
    findings.extend(cpu::planning_dominated(&queries));
    findings.extend(phases::unusual_phase(&queries));
    findings.extend(indexes::repeated_descents(&queries));
    let period = evidence.on_cpu.meta.period;
    let time = statement_time(&queries, period, evidence.off_cpu);
    let share_of = match evidence.off_cpu {
        Some(_) => functions::ShareOf::Time,
        None => functions::ShareOf::CpuSamples(evidence.on_cpu),
    };
    findings.extend(functions::dominating(
        evidence.probes,
        &time,
        cpu::MIN_SAMPLES * period,
        share_of,
    ));
    let seconds = evidence.on_cpu.meta.duration_nanos as f64 / 1e9;
    findings.extend(spin_sites::spinning_sites(
        evidence.spin_sites,
        evidence.probes,
        &time,
        seconds,
    ));
    findings.extend(cpu::spinning(&queries, evidence.on_cpu));
    findings.extend(cpu::generic_plan_locking(&queries));
    findings.extend(probes::locks_per_execution(evidence.probes));
    findings.extend(pgss::evictions(evidence.pgss.as_ref(), evidence.off_cpu));
    findings.extend(cpu::top_consumers(&queries, evidence.on_cpu.total_count()));
    findings.extend(waits::top_waiters(evidence.off_cpu));
    if let Some(instance) = evidence.instance {
        facts::annotate(&mut findings, instance);
    }
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    findings
}

/// Each statement's time: its on-CPU samples × the sampling period, plus its off-CPU time
/// without the client's time.
fn statement_time(
    queries: &[cpu::QueryCpu],
    period_ns: u64,
    off_cpu: Option<&Profile>,
) -> functions::StatementTime {
    let mut time: functions::StatementTime = queries
        .iter()
        .map(|q| (q.query_id, q.samples * period_ns))
        .collect();
    for sample in off_cpu.iter().flat_map(|p| &p.samples) {
        if is_client_time(sample) {
            continue;
        }
        if let Some(query_id) = sample.label("queryid").and_then(|q| q.parse().ok()) {
            *time.entry(query_id).or_insert(0) += sample.count;
        }
    }
    time
}

/// The findings as the end of a trace prints them.
pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    for finding in findings {
        let _ = writeln!(out, "[{}] {}", finding.severity.name(), finding.title);
        for (what, value) in &finding.numbers {
            let _ = writeln!(out, "    {what}: {value}");
        }
        if !finding.frames.is_empty() {
            let _ = writeln!(out, "    frames: {}", finding.frames.join(", "));
        }
        let _ = writeln!(out, "    → {}", finding.action);
    }
    out
}

/// Whether an off-CPU sample is the client's time rather than the statement's: idle between
/// statements, or waiting for the client inside a transaction (`Client:*`: its think time and
/// round trips, while the previous statement's queryid stays in force).
fn is_client_time(sample: &exporters::StackSample) -> bool {
    sample.label("off_cpu") == Some("idle")
        || sample
            .label("wait_event")
            .is_some_and(|w| w.starts_with("Client:"))
}

/// `12.3%`.
fn percent(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}
