//! Findings: what the measurements mean, in a DBA's words. Each rule reads the analysis of
//! what a trace (or an agent interval) gathered ([`crate::model`]: statements' CPU by phase and
//! function, their waits and time, function-probe counts) and says what it found, with the numbers, the queryids and frames involved and
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

use crate::model::{Analysis, QueryId};

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
    pub query_ids: Vec<QueryId>,
    pub frames: Vec<String>,
    /// What to consider doing.
    pub action: String,
}

/// Every rule over the analysed measurements, most severe first.
pub fn evaluate(analysis: &Analysis) -> Vec<Finding> {
    let measured = &analysis.measured;
    let statements = &analysis.statements;
    let mut findings = Vec::new();
    findings.extend(cpu::planning_dominated(statements));
    findings.extend(phases::unusual_phase(statements));
    findings.extend(indexes::repeated_descents(statements));
    let share_of = match measured.off_cpu {
        Some(_) => functions::ShareOf::Time,
        None => functions::ShareOf::CpuSamples(measured.on_cpu),
    };
    findings.extend(functions::dominating(
        measured.probes,
        &analysis.statement_time,
        cpu::MIN_SAMPLES * analysis.period_ns(),
        share_of,
    ));
    findings.extend(spin_sites::spinning_sites(
        measured.spin_sites,
        measured.probes,
        &analysis.statement_time,
        analysis.seconds(),
    ));
    findings.extend(cpu::spinning(statements, analysis.cpu_samples()));
    findings.extend(cpu::generic_plan_locking(statements));
    findings.extend(probes::locks_per_execution(measured.probes));
    findings.extend(pgss::evictions(measured.pgss.as_ref(), analysis.waits.as_ref()));
    findings.extend(cpu::top_consumers(statements, analysis.cpu_samples()));
    findings.extend(waits::top_waiters(analysis.waits.as_ref()));
    if let Some(instance) = measured.instance {
        facts::annotate(&mut findings, instance);
    }
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    findings
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

/// `12.3%`.
fn percent(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The first queryid each finding names, in order.
    pub fn named(found: &[Finding]) -> Vec<QueryId> {
        found
            .iter()
            .filter_map(|f| f.query_ids.first().copied())
            .collect()
    }
}
