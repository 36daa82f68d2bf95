//! Findings: what the measurements mean, in a DBA's words. Each rule reads the analysis of
//! what a trace (or an agent interval) gathered ([`crate::model`]: statements' CPU by phase and
//! function, their waits and time, function-probe counts) and says what it found, with the numbers, the queryids and frames involved and
//! what to consider. Rules follow Postgres mechanics (what a phase or a function does), with
//! thresholds on shares of the measured time, not on particular workloads.

mod blockers;
mod buffer_reads;
mod causes;
mod citations;
mod commit_waits;
mod counted;
mod cpu;
mod facts;
mod families;
mod foreign_keys;
mod functions;
mod group;
mod hot_function;
mod indexes;
mod jit;
mod pgss;
mod phases;
mod plan_locking;
mod probes;
mod row_locks;
mod sessions;
mod spills;
mod spin_sites;
mod waits;

use std::fmt::Write as _;

pub use group::StatementCause;

use crate::model::{shorten, Analysis, QueryId};

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
    /// A rule's verdict once its figure passed its warning bar: critical from `critical` on.
    pub fn warning_or_critical(figure: f64, critical: f64) -> Self {
        if figure >= critical {
            Severity::Critical
        } else {
            Severity::Warning
        }
    }

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
    /// For a finding about statements: the cause they share, each one's figure and what it
    /// cost; findings of one rule over the same functions are grouped by it.
    pub cause: Option<StatementCause>,
}

/// A cost under this share of all the time measured never rises above information (issue 36's
/// contract (e)): what costs the instance a two-hundredth of its time is not what to act on.
/// Statement causes are held far above it by their weighing (`group`); the instance-wide rules
/// apply it to the time they measure.
pub const NEGLIGIBLE_SHARE: f64 = 0.005;

/// Information findings at most, after the warnings and criticals: the busiest statements and
/// sites, not every one (dozens would bury what needs acting on).
pub const MAX_INFO_FINDINGS: usize = 10;

/// Every rule over the analysed measurements, most severe first, information capped at
/// [`MAX_INFO_FINDINGS`].
pub fn evaluate(analysis: &Analysis) -> Vec<Finding> {
    let measured = &analysis.measured;
    let statements = &analysis.statements;
    let mut findings = Vec::new();
    let period = analysis.period_ns();
    findings.extend(cpu::planning_dominated(statements, period));
    findings.extend(phases::unusual_phase(statements, period));
    findings.extend(jit::jit_compilation(statements, measured.instance, period));
    findings.extend(indexes::repeated_descents(statements, period));
    let share_of = match measured.off_cpu {
        Some(off_cpu) => functions::ShareOf::Time {
            on_cpu: measured.on_cpu,
            off_cpu,
        },
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
    findings.extend(cpu::spinning(statements, analysis.cpu_samples(), period));
    findings.extend(plan_locking::generic_plan_locking(
        statements,
        &analysis.walls,
        period,
    ));
    findings.extend(probes::locks_per_execution(measured.probes));
    findings.extend(pgss::evictions(
        measured.pgss.as_ref(),
        analysis.waits.as_ref(),
        analysis.backend_time_ns(),
    ));
    findings.extend(spills::spilling_operators(
        statements,
        measured.instance,
        &analysis.walls,
        period,
    ));
    findings.extend(buffer_reads::shared_buffer_misses(
        statements,
        measured.instance,
        &analysis.walls,
        period,
    ));
    findings.extend(families::family_costs(statements, measured.instance, period));
    findings.extend(foreign_keys::unindexed_foreign_keys(statements, period));
    findings.extend(row_locks::row_lock_contention(&analysis.walls, measured.blockers));
    findings.extend(commit_waits::commit_flush_waits(&analysis.walls));
    findings.extend(sessions::connection_churn(
        measured.on_cpu,
        measured.instance,
        analysis.seconds(),
    ));
    findings.extend(hot_function::unexplained(statements, &findings, period));
    // Rules that measure one mechanism their own ways, on one statement: one finding, one cost.
    let findings = causes::one_finding_per_cause(findings);
    let commands = measured.instance.map(|facts| &facts.commands_by_query);
    let mut findings = group::group_and_weigh(
        findings,
        group::InstanceTime {
            backend_ns: analysis.backend_time_ns(),
            seconds: analysis.seconds(),
        },
        |query_id| commands?.get(&query_id.to_string()).cloned(),
    );
    let top = cpu::top_consumers(statements, analysis.cpu_samples(), &findings);
    findings.extend(top);
    findings.extend(waits::top_waiters(
        analysis.waits.as_ref(),
        &analysis.walls,
        measured.postgres_major,
    ));
    findings.extend(waits::host_cpu_contention(
        analysis.waits.as_ref(),
        analysis.backend_time_ns(),
    ));
    findings.extend(blockers::blocking_sessions(
        measured.blockers,
        analysis.backend_time_ns(),
    ));
    citations::cite_only_sampled(&mut findings, measured.on_cpu, measured.off_cpu);
    if let Some(instance) = measured.instance {
        facts::annotate(&mut findings, instance);
    }
    // Most severe first; within a severity, the order above (statement causes by their cost
    // to the instance, then the top consumers).
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    cap_info(&mut findings);
    findings
}

/// Keeps the first [`MAX_INFO_FINDINGS`] information findings of `findings` (sorted most
/// severe first, each rule's own order kept), and every other.
fn cap_info(findings: &mut Vec<Finding>) {
    let mut info = 0;
    findings.retain(|f| {
        if f.severity != Severity::Info {
            return true;
        }
        info += 1;
        info <= MAX_INFO_FINDINGS
    });
}

/// The findings as the end of a trace prints them, each statement they cite named by its
/// normalized text where `text_of` knows it (pg_stat_statements).
pub fn render<'a>(findings: &[Finding], text_of: impl Fn(QueryId) -> Option<&'a str>) -> String {
    let mut out = String::new();
    for finding in findings {
        let _ = writeln!(out, "[{}] {}", finding.severity.name(), finding.title);
        for line in statement_lines(finding, &text_of) {
            let _ = writeln!(out, "    {line}");
        }
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

/// The statements `finding` covers, one line each (`statement <queryid> (<its figure>):
/// <text>`), at most [`group::MAX_LISTED`] and a count of the rest. A statement with neither
/// a figure nor a known text is left to the title.
pub fn statement_lines<'a>(finding: &Finding, text_of: &impl Fn(QueryId) -> Option<&'a str>) -> Vec<String> {
    let figures = finding.cause.as_ref().map(|c| c.figures.as_slice());
    let grouped = finding.query_ids.len() > 1;
    let mut lines = Vec::new();
    for (i, &query_id) in finding.query_ids.iter().enumerate() {
        if i == group::MAX_LISTED {
            lines.push(format!(
                "… and {} more statements",
                finding.query_ids.len() - group::MAX_LISTED
            ));
            break;
        }
        let figure = figures
            .and_then(|f| f.get(i))
            .filter(|f| grouped && !f.is_empty())
            .map(|f| format!(" ({f})"))
            .unwrap_or_default();
        match text_of(query_id) {
            Some(text) => lines.push(format!(
                "statement {query_id}{figure}: {}",
                shorten(text, STATEMENT_TEXT_CHARS)
            )),
            None if !figure.is_empty() => lines.push(format!("statement {query_id}{figure}")),
            None => {}
        }
    }
    lines
}

/// How much of a statement's text a finding shows.
pub const STATEMENT_TEXT_CHARS: usize = 100;

/// `12.3%`. A share that is not zero never reads `0.0%`: below 0.1% it keeps two significant digits
/// (`0.0014%`), so that a small figure still says what supports it.
fn percent(share: f64) -> String {
    let pct = share * 100.0;
    if pct > 0.0 && pct < 0.05 {
        let digits = (1 - pct.log10().floor() as i32).clamp(2, 12) as usize;
        format!("{pct:.digits$}%")
    } else {
        format!("{pct:.1}%")
    }
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

    fn finding(severity: Severity, query_id: i64) -> Finding {
        Finding {
            kind: "test",
            severity,
            title: String::new(),
            numbers: Vec::new(),
            query_ids: vec![QueryId(query_id)],
            frames: Vec::new(),
            action: String::new(),
            cause: None,
        }
    }

    #[test]
    fn information_is_capped_and_nothing_else_is() {
        let mut found: Vec<Finding> = (0..3).map(|q| finding(Severity::Critical, q)).collect();
        found.extend((10..30).map(|q| finding(Severity::Info, q)));
        found.push(finding(Severity::Warning, 99));
        found.sort_by_key(|f| std::cmp::Reverse(f.severity));
        cap_info(&mut found);
        let info: Vec<QueryId> = named(&found[4..]);
        assert_eq!(found.len(), 4 + MAX_INFO_FINDINGS);
        assert_eq!(named(&found[..3]), vec![QueryId(0), QueryId(1), QueryId(2)]);
        assert_eq!(found[3].severity, Severity::Warning);
        assert_eq!(
            info,
            (10..10 + MAX_INFO_FINDINGS as i64)
                .map(QueryId)
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn statements_are_shown_with_their_text_where_known() {
        let found = vec![finding(Severity::Warning, 7), finding(Severity::Info, 8)];
        let long = format!("SELECT {} FROM t", "x, ".repeat(60));
        let text = |q: QueryId| match q.0 {
            7 => Some(long.as_str()),
            _ => None,
        };
        let rendered = render(&found, text);
        let lines: Vec<&str> = rendered.lines().filter(|l| l.contains("statement")).collect();
        assert_eq!(lines.len(), 1, "{rendered}");
        assert!(
            lines[0].starts_with("    statement 7: SELECT x, x,"),
            "{rendered}"
        );
        assert!(
            lines[0].ends_with('…'),
            "cut at {STATEMENT_TEXT_CHARS} characters: {rendered}"
        );
    }

    #[test]
    fn a_share_that_is_not_zero_never_prints_as_zero() {
        assert_eq!(percent(0.123), "12.3%");
        assert_eq!(percent(0.0005), "0.1%");
        assert_eq!(percent(0.000_014), "0.0014%");
        assert_eq!(percent(0.000_000_3), "0.000030%");
        assert_eq!(percent(0.0), "0.0%");
    }
}
